"""Rows: load them, and walk them in a resumable order.

A row is any JSON object; the user's ``rollout_fn`` is the only code that reads its fields. One
convenience: a row's prompt token ids may be named ``prompt_token_ids`` (the Fireworks cookbook's
documented name) or ``prompt_ids`` (this repository's examples); ``load_rows`` gives a row that
has one name the other too (the same list), so a rollout reading either name works on both.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Union

Rows = Union[list, str, Path]

PROMPT_TOKEN_KEYS = ("prompt_token_ids", "prompt_ids")
"""The two names of a row's prompt token ids."""


def load_rows(rows: Rows) -> list[dict]:
    """A list of dicts, or the path of a ``.jsonl`` file (one object per line)."""
    if isinstance(rows, (str, Path)):
        path = Path(rows)
        if not path.exists():
            raise FileNotFoundError(
                f"rows: no such file {path}; give the path of a .jsonl file (one JSON object per line)"
            )
        out = []
        with path.open() as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"rows: {path}:{i} is not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"rows: {path}:{i} is a {type(obj).__name__}, expected a JSON object")
                out.append(obj)
        rows = out
    if not isinstance(rows, list):
        raise TypeError(f"rows: expected a list of dicts or a .jsonl path, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TypeError(f"rows[{i}]: expected a dict, got {type(r).__name__}")
    if not rows:
        raise ValueError("rows: empty; give at least one row")
    return [_with_both_prompt_names(r) for r in rows]


def _with_both_prompt_names(row: dict) -> dict:
    """``row``, or a shallow copy that carries its prompt ids under both ``PROMPT_TOKEN_KEYS``."""
    present = [k for k in PROMPT_TOKEN_KEYS if k in row]
    if len(present) != 1:
        return row
    (missing,) = [k for k in PROMPT_TOKEN_KEYS if k not in row]
    return {**row, missing: row[present[0]]}


@dataclass
class RowCursor:
    """Walks ``epochs`` passes over ``num_rows`` rows, shuffled per epoch by ``seed``.

    Positions count across epochs (position ``p`` is row ``order(p // n)[p % n]``). A position
    is *done* once its group was trained, filtered or dropped; ``state()`` records the first
    position not done plus the done positions after it, so a resumed run re-runs exactly the
    rows that were in flight when it stopped.
    """

    num_rows: int
    epochs: int = 1
    seed: int = 0
    shuffle: bool = True
    next_position: int = 0
    done_floor: int = 0
    done_after_floor: set = field(default_factory=set)
    requeued: list = field(default_factory=list)
    """Positions handed out before and given back (``requeue``); taken again first."""
    _orders: dict = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return self.num_rows * self.epochs

    def row_index(self, position: int) -> int:
        epoch, i = divmod(position, self.num_rows)
        if not self.shuffle:
            return i
        if epoch not in self._orders:
            order = list(range(self.num_rows))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch][i]

    def take(self) -> int | None:
        """The next position to submit (requeued ones first), or None when every pass is submitted."""
        if self.requeued:
            return self.requeued.pop(0)
        while self.next_position < self.total and self.next_position in self.done_after_floor:
            self.next_position += 1
        if self.next_position >= self.total:
            return None
        p = self.next_position
        self.next_position += 1
        return p

    def has_next(self) -> bool:
        """True if ``take`` would return a position."""
        if self.requeued:
            return True
        p = self.next_position
        while p < self.total and p in self.done_after_floor:
            p += 1
        return p < self.total

    def requeue(self, position: int) -> None:
        """Give back a taken position that was not trained (e.g. dropped as stale): it is taken again next."""
        self.requeued.append(position)

    def mark_done(self, position: int) -> None:
        self.done_after_floor.add(position)
        while self.done_floor in self.done_after_floor:
            self.done_after_floor.remove(self.done_floor)
            self.done_floor += 1

    def state(self) -> dict:
        return {"done_floor": self.done_floor, "done_after_floor": sorted(self.done_after_floor)}

    def load_state(self, state: dict) -> None:
        self.done_floor = int(state["done_floor"])
        self.done_after_floor = set(int(p) for p in state["done_after_floor"])
        self.next_position = self.done_floor
        self.requeued = []

    def positions(self) -> Iterator[int]:
        while (p := self.take()) is not None:
            yield p
