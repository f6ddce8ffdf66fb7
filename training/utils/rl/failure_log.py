"""``FailureLog``: rollout failures reported so a user can act on them, without flooding the log.

The first failure of each kind is logged in full: for an exception, its type and the place it was
raised (file and line of the innermost frame) make the kind, and the warning carries the whole
traceback; for a timeout or an invalid result, the cause (``timeout``, the contract field) makes it.
Every later failure of a kind already printed is only counted (``take_unprinted``: the recipes
report the count per step as ``rollout/failures_unprinted``). Each message names the data row:
its index in the user's rows and, when the row has one, its ``id`` (``row_label``).
"""

from __future__ import annotations

import logging
import traceback
from typing import Optional

logger = logging.getLogger("training.rollout")


def row_label(row: dict, row_index: Optional[int], position: Optional[int] = None) -> str:
    """``data row 126 (id 'q-7')``: the row's index in the user's rows and its ``id`` when it has one."""
    label = f"data row {row_index}" if row_index is not None else f"row at position {position}"
    if isinstance(row, dict) and row.get("id") is not None:
        label += f" (id {row['id']!r})"
    return label


def raised_at(error: BaseException) -> str:
    """``file.py:42 in fn``: where ``error`` was raised (its innermost traceback frame), or ``?``."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


class FailureLog:
    """Print the first failure of each kind (with its traceback), count the rest."""

    def __init__(self, what: str = "rollout"):
        self.what = what
        """The word messages start with: ``rollout`` or ``eval rollout``."""
        self.seen: dict[tuple[str, ...], int] = {}
        """Failures so far, by kind."""
        self.unprinted = 0
        """Failures counted but not printed since the last ``take_unprinted``."""

    def _first(self, kind: tuple[str, ...]) -> bool:
        n = self.seen.get(kind, 0)
        self.seen[kind] = n + 1
        if n:
            self.unprinted += 1
        return n == 0

    def exception(self, label: str, error: BaseException) -> None:
        """``label``'s rollout raised ``error``."""
        where = raised_at(error)
        if self._first(("raised", type(error).__name__, where)):
            logger.warning(
                "%s of %s raised %s: %s (at %s; later %s failures raised there are counted, not printed)",
                self.what,
                label,
                type(error).__name__,
                error,
                where,
                type(error).__name__,
                exc_info=(type(error), error, error.__traceback__),
            )

    def problem(self, label: str, cause: str, message: str) -> None:
        """``label``'s rollout failed without an exception of its own (``cause``: ``timeout``, a contract field)."""
        if self._first(("problem", cause)):
            logger.warning(
                "%s of %s %s (later failures of this kind are counted, not printed)", self.what, label, message
            )

    def take_unprinted(self) -> int:
        """Failures counted but not printed since the last call."""
        n, self.unprinted = self.unprinted, 0
        return n
