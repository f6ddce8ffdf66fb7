"""The run record, ``<log_path>/config.json``, and the policy for a ``log_path`` that holds a run.

- A run writes its config (JSON, callables by name) to ``config.json`` when it starts.
- ``resolve_log_path`` picks the folder a run writes to, by ``if_log_path_exists`` (``IF_EXISTS``):
  ``resume_or_new`` (the default) resumes ``log_path`` when it has a checkpoint and the same
  training settings, and otherwise writes to the first free numbered folder beside it
  (``runs/x-2``, ``runs/x-3``, ...; one that can be resumed is resumed); ``resume`` resumes or
  refuses; ``new`` always takes a free folder; ``overwrite`` deletes the old run first; ``error``
  refuses any folder that holds a run. Nothing is lost silently: a run never appends to another
  run's metrics, and a new folder is named in the log.
- ``check_log_path`` (the ``resume`` policy) lists every difference against ``config.json`` and
  refuses, unless the caller allows it (then the differences are logged and the record is
  rewritten); a ``log_path`` that holds a run without a checkpoint is refused.
- A refusal is a ``LogPathInUse``: a ``SystemExit`` with a one-line message, so a script that runs
  into it prints that line and exits, without a traceback.
- A checkpoint counts when it verifies (``checkpoint_files.verify_checkpoint``, the same test the resume
  uses): a damaged newest one does not hide an intact older one. A ``log_path`` whose checkpoint folders
  all fail is refused under ``resume`` / ``resume_or_new`` (``NoUsableCheckpoint``, each folder and why)
  instead of starting over.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Iterable

from training.utils.checkpoint_files import (
    checkpoint_folders,
    has_usable_checkpoint,
    scan_checkpoints,
    unusable_message,
)

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
IF_EXISTS = ("resume_or_new", "resume", "new", "overwrite", "error")
"""The values of ``if_log_path_exists`` (see the module docstring)."""
MAX_NUMBERED = 1000
"""How many numbered folders (``x-2`` .. ``x-1000``) ``resolve_log_path`` tries before it gives up."""


class LogPathInUse(SystemExit):
    """``log_path`` holds another run (or this run with other settings) and the policy refuses it.

    A ``SystemExit`` so that a script prints its one-line message and exits with code 1, without a
    traceback; code that calls ``main`` catches it by name. ``str(e)`` is the message."""

    def __str__(self) -> str:
        return str(self.code)


class NoUsableCheckpoint(LogPathInUse):
    """``log_path`` holds checkpoint folders but none verifies or loads: the message names each and why, and the fix
    (delete the checkpoints folder or use another ``log_path``); the run never starts over from step 0 silently."""


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
                f"error: log_path {log_path} holds a run with other settings (recorded -> now: "
                + "; ".join(diffs)
                + f"); use another log_path, if_log_path_exists=new, or {resume_flag}=True to resume with these changes"
            )
        if diffs:
            log.warning("resuming %s with changed settings:\n  %s", log_path, "\n  ".join(diffs))
        return
    metrics = log_path / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size > 0:
        raise LogPathInUse(
            f"error: log_path {log_path} already holds a run ({metrics.name} has rows) and no checkpoint to resume "
            "from; use another log_path, or if_log_path_exists=new (a numbered folder) or overwrite (deletes it)"
        )


def write_config_record(log_path: str | Path, config: dict) -> Path:
    """Write ``config.json`` (callables and other non-JSON values by their ``str``)."""
    path = Path(log_path) / CONFIG_FILE
    path.write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return path


def has_checkpoint(log_path: str | Path) -> bool:
    """Whether ``log_path`` has a checkpoint to resume from: any ``checkpoints/step_*`` folder that verifies, the
    test of ``training.utils.checkpoint.latest_checkpoint``, without importing torch (``Config`` imports this
    module)."""
    return has_usable_checkpoint(Path(log_path) / "checkpoints")


def refuse_unusable_checkpoints(log_path: str | Path) -> None:
    """Raise ``NoUsableCheckpoint`` when ``log_path`` holds checkpoint folders and none of them verifies."""
    root = Path(log_path) / "checkpoints"
    problems = []
    for folder, why in scan_checkpoints(root):
        if why is None:
            return
        problems.append((folder, why))
    if problems:
        raise NoUsableCheckpoint(unusable_message(root, problems))


def holds_run(log_path: str | Path) -> bool:
    """Whether ``log_path`` holds a run: a checkpoint folder (usable or not), or rows in ``metrics.jsonl``."""
    metrics = Path(log_path) / "metrics.jsonl"
    return bool(checkpoint_folders(Path(log_path) / "checkpoints")) or (metrics.exists() and metrics.stat().st_size > 0)


def _resumable(log_path: Path, config: dict, ignore: Iterable[str], resume_anyway: bool) -> bool:
    if not has_checkpoint(log_path):
        return False
    record = log_path / CONFIG_FILE
    if resume_anyway or not record.exists():
        return True
    new = json.loads(json.dumps(config, default=str))
    return not config_differences(json.loads(record.read_text()), new, ignore=ignore)


def _numbered(log_path: Path) -> Iterable[Path]:
    yield log_path
    for k in range(2, MAX_NUMBERED + 1):
        yield log_path.with_name(f"{log_path.name}-{k}")


def resolve_log_path(
    log_path: str | Path,
    config: dict,
    policy: str = "resume_or_new",
    *,
    ignore: Iterable[str] = (),
    resume_anyway: bool = False,
    resume_flag: str = "resume_with_changed_config",
) -> Path:
    """The folder this run writes to under ``policy`` (one of ``IF_EXISTS``; see the module docstring).

    Raises ``LogPathInUse`` when the policy refuses. Creates nothing, except that ``overwrite``
    deletes a folder holding a run (only one with a ``config.json``: a run folder). A run that
    moves to a numbered folder is logged in one line."""
    if policy not in IF_EXISTS:
        raise ValueError(f"if_log_path_exists: {policy!r} is not one of {IF_EXISTS}")
    log_path = Path(log_path)
    ignore = tuple(ignore)
    if policy in ("resume", "resume_or_new"):
        refuse_unusable_checkpoints(log_path)
    if policy == "resume":
        check_log_path(
            log_path,
            config,
            has_checkpoint=has_checkpoint(log_path),
            ignore=ignore,
            resume_anyway=resume_anyway,
            resume_flag=resume_flag,
        )
        return log_path
    if not holds_run(log_path):
        return log_path
    if policy == "error":
        raise LogPathInUse(
            f"error: log_path {log_path} already holds a run (if_log_path_exists=error); use another log_path, or "
            "if_log_path_exists=resume_or_new / new / overwrite"
        )
    if policy == "overwrite":
        if not (log_path / CONFIG_FILE).exists():
            raise LogPathInUse(
                f"error: if_log_path_exists=overwrite deletes only a run folder (one with {CONFIG_FILE}); "
                f"{log_path} has none, so it is left alone; use another log_path"
            )
        shutil.rmtree(log_path)
        log.warning("if_log_path_exists=overwrite: deleted the run in %s", log_path)
        return log_path
    for candidate in _numbered(log_path):
        if policy == "resume_or_new" and _resumable(candidate, config, ignore, resume_anyway):
            check_log_path(candidate, config, has_checkpoint=True, ignore=ignore, resume_anyway=True)  # logs changes
            if candidate != log_path:
                log.warning("%s holds a run with other settings; resuming the matching run in %s", log_path, candidate)
            return candidate
        if not holds_run(candidate):
            why = "holds a run with other settings" if has_checkpoint(log_path) else "holds a run without a checkpoint"
            if policy == "new":
                why = "holds a run"
            log.warning(
                "%s %s; this run writes to %s (if_log_path_exists=%s; =resume resumes or refuses)",
                log_path,
                why,
                candidate,
                policy,
            )
            return candidate
    raise LogPathInUse(
        f"error: {log_path} and its {MAX_NUMBERED - 1} numbered neighbours all hold runs; use another log_path"
    )
