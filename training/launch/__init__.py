"""Launchers beyond one machine: the Ray launcher (``python -m training.launch.ray``; see README.md here)."""
