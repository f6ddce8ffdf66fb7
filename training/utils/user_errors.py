"""A user's mistake ends a ``train.py`` run in one line; its traceback goes to ``<log_path>/error.log``.

``mark_user_error(error, log_path)`` (called by ``run_recipe`` for the mistakes it knows: a bad setting, a missing
data file, a rollout that breaks the contract) writes the traceback to the run's folder and marks the error;
``install_excepthook()`` (called by ``apply_overrides``, so every ``train.py`` command line has it) prints a marked
error, a ``ConfigError`` or an ``ImportError`` (a missing extra) as ``run stopped: <message>`` instead of a traceback.
``--debug`` on the command line (``training/utils/cli.py``), or ``TRAINING_DEBUG=1``, keeps the traceback.
Library callers (tests, notebooks) get the exceptions unchanged.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Optional

from training.utils.config import ConfigError

DEBUG_ENV = "TRAINING_DEBUG"
"""Set to 1 (by ``--debug``) to see a user error's traceback on the console."""


def debugging() -> bool:
    """True when the console should show a user error's traceback (``--debug`` / ``TRAINING_DEBUG=1``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def mark_user_error(error: BaseException, log_path: Optional[Path]) -> None:
    """Mark ``error`` as the user's; write its traceback to ``<log_path>/error.log`` when that folder exists."""
    error.user_error = True
    if log_path is not None and Path(log_path).is_dir():
        try:
            path = Path(log_path) / "error.log"
            path.write_text("".join(traceback.format_exception(error)))
            error.error_log = str(path)
        except OSError:
            pass


def is_user_error(error: BaseException) -> bool:
    """Marked by ``mark_user_error``, a ``ConfigError``, or a package that is not installed (an ``ImportError``).
    A name missing from this library's own modules (``training.*``) is a bug or a broken install, not a missing
    extra: it keeps its traceback."""
    if isinstance(error, ImportError) and (error.name or "").split(".")[0] == "training":
        return False
    return bool(getattr(error, "user_error", False)) or isinstance(error, (ConfigError, ImportError))


def one_line(error: BaseException) -> str:
    """``run stopped: <first line of the message> (where the traceback is)``."""
    text = str(error).strip()
    message = text.splitlines()[0] if text else type(error).__name__
    if isinstance(error, ImportError) and "pip install" not in message:
        message += ': install the extra that provides it (pip install -e ".[<extra>]", see pyproject.toml)'
    log = getattr(error, "error_log", None)
    where = f"traceback in {log}; --debug shows it here" if log else "--debug shows the traceback"
    return f"run stopped: {message} ({where})"


def install_excepthook() -> None:
    """Print an uncaught user error as one line (exit status 1); any other error keeps its traceback."""
    previous = sys.excepthook
    if getattr(previous, "one_line_hook", False):
        return

    def hook(kind, error, tb):
        if debugging() or not is_user_error(error):
            return previous(kind, error, tb)
        print(one_line(error), file=sys.stderr)

    hook.one_line_hook = True
    sys.excepthook = hook
