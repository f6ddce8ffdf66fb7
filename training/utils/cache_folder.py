"""The project's cache folder: ``$TRAINING_CACHE``, else ``~/.cache/training``.

Built models (``training/models``: the tiny model, converted SmolLM2) and the engine's compiled
decode step (``native/``) live under it; both floors read the folder from here.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the project's cache: ``$TRAINING_CACHE`` or ``~/.cache/training`` (not created here)."""
    return Path(os.environ.get("TRAINING_CACHE", Path.home() / ".cache" / "training"))
