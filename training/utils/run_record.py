"""The run record, ``<log_path>/config.json``, and the guards that keep two runs out of one folder.

- A run writes its config (JSON, callables by name) to ``config.json`` when it starts.
- Rerunning into a ``log_path`` that has a checkpoint resumes it, but only with the same training
  settings: ``check_log_path`` lists every difference against ``config.json`` and refuses, unless
  the caller allows it (then the differences are logged and the record is rewritten).
- A ``log_path`` that holds a run without a checkpoint (its ``metrics.jsonl`` has rows) is refused:
  a second run would otherwise append to the first one's metrics.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


class LogPathInUse(RuntimeError):
    """``log_path`` holds another run (or this run with other settings)."""


def config_differences(old: Any, new: Any, prefix: str = "", ignore: Iterable[str] = ()) -> list[str]:
    """``"key: old -> new"`` for every leaf that differs (dotted keys; ``ignore`` names keys or key prefixes)."""
    ignore = tuple(ignore)
    if prefix and any(prefix == k or prefix.startswith(k + ".") for k in ignore):
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += config_differences(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key), ignore)
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def check_log_path(
    log_path: str | Path,
    config: dict,
    *,
    has_checkpoint: bool,
    ignore: Iterable[str] = (),
    resume_anyway: bool = False,
    resume_flag: str = "resume_with_changed_config",
) -> None:
    """Refuse a run that would mix with another in ``log_path`` (see the module docstring).

    ``config`` is the JSON view of this run's config; ``ignore`` lists keys that may change on a
    resume (e.g. ``max_steps``); ``resume_flag`` is the setting the error message points to.
    """
    log_path = Path(log_path)
    record = log_path / CONFIG_FILE
    if has_checkpoint:
        if not record.exists():
            return  # a run from before the record existed: nothing to compare
        old = json.loads(record.read_text())
        diffs = config_differences(old, json.loads(json.dumps(config, default=str)), ignore=ignore)
        if diffs and not resume_anyway:
            raise LogPathInUse(
                f"log_path {log_path} holds a run with other settings, and rerunning resumes it. Differences "
                f"(recorded -> now):\n  "
                + "\n  ".join(diffs)
                + f"\nUse another log_path for a new run, or set {resume_flag}=True to resume with these changes."
            )
        if diffs:
            log.warning("resuming %s with changed settings:\n  %s", log_path, "\n  ".join(diffs))
        return
    metrics = log_path / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size > 0:
        raise LogPathInUse(
            f"log_path {log_path} already holds a run ({metrics} has rows) and no checkpoint to resume from; a "
            "second run would mix its metrics with the first one's. Use another log_path, or delete that folder. "
            "(Runs with dcp_save_interval > 0 resume from their newest checkpoint instead.)"
        )


def write_config_record(log_path: str | Path, config: dict) -> Path:
    """Write ``config.json`` (callables and other non-JSON values by their ``str``)."""
    path = Path(log_path) / CONFIG_FILE
    path.write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return path
