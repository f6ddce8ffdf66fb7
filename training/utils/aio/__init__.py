"""asyncio helpers of the recipes, the proxy and the agents: running a recipe's loop (``loop_runner.py``), the
event-loop watchdog and its deadline-aware ``wait_for`` (``loop_watch.py``), and the pause gate around weight
syncs (``pause_gate.py``)."""
