"""``ResponseStore``: the bounded memory behind ``previous_response_id``.

A response created with ``store`` (the default) leaves its conversation here: the chat messages of the
earlier responses it continued, its own input and its output (never the instructions). A follow-up that
names it continues that conversation. The store keeps the most recently used responses within two bounds,
``max_responses`` and ``max_chars`` (the conversations' JSON size, summed); the least recently used one is
dropped first, and a later request naming it is refused (404 naming ``previous_response_id``). The
deployment server keeps one store; the training proxy one per session (so an id works within its session
only).
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from typing import Optional

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_CHARS = 64 * 1024 * 1024


class ResponseStore:
    """Response id -> conversation (chat messages), least recently used dropped first."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_chars: int = DEFAULT_MAX_CHARS):
        if max_responses < 1 or max_chars < 1:
            raise ValueError(f"max_responses and max_chars must be >= 1, got {max_responses}, {max_chars}")
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, tuple[list[dict], int]] = OrderedDict()
        self.chars = 0
        self.dropped = 0
        """Responses dropped to stay within the bounds."""

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._items

    def put(self, response_id: str, messages: list[dict]) -> None:
        """Keep ``messages`` under ``response_id`` (a conversation larger than ``max_chars`` is not kept)."""
        size = len(json.dumps(messages, ensure_ascii=False, default=str))
        if response_id in self._items:
            self.chars -= self._items.pop(response_id)[1]
        if size > self.max_chars:
            self.dropped += 1
            return
        self._items[response_id] = (copy.deepcopy(messages), size)
        self.chars += size
        while len(self._items) > self.max_responses or self.chars > self.max_chars:
            _, (_, dropped_size) = self._items.popitem(last=False)
            self.chars -= dropped_size
            self.dropped += 1

    def get(self, response_id: str) -> Optional[list[dict]]:
        """The conversation of ``response_id`` (a copy), or None when it was never kept or was dropped."""
        entry = self._items.get(response_id)
        if entry is None:
            return None
        self._items.move_to_end(response_id)
        return copy.deepcopy(entry[0])

    def missing_message(self, response_id: str, where: str = "here") -> str:
        """Why ``response_id`` cannot be continued (for the 404); ``where`` names the store's scope."""
        return (
            f"previous response {response_id!r} not found {where}: it was never created there, was created with "
            f"'store': false, or was dropped (the last {self.max_responses} responses are kept)"
        )

    def pool(self) -> dict:
        """``{"size", "bound"}`` for a server's ``/stats`` pools."""
        return {"size": len(self._items), "bound": self.max_responses}
