"""``JudgeCache``: judge answers by content hash, in memory (least recently used first out) and optionally on disk.

The key is ``content_key(request)``: the SHA-256 of the request as canonical JSON (sorted keys, no whitespace), so
the same model, messages, schema, sampling settings and seed give the same key in any process. Only answers that
parsed are stored, so a failed judgement is asked again. On disk an entry is one JSON file
``<cache_dir>/<key[:2]>/<key>.json``, written to a temporary file and renamed (a reader never sees half a file);
a file that does not read back as a JSON object counts as a miss. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional


def content_key(request: Any) -> str:
    """SHA-256 hex digest of ``request`` as canonical JSON."""
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


class JudgeCache:
    """Answers by content key: at most ``max_entries`` in memory, every one under ``cache_dir`` when given."""

    def __init__(self, max_entries: int = 10_000, cache_dir: Optional[str] = None):
        if max_entries < 0:
            raise ValueError(f"max_entries: must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._memory: OrderedDict[str, dict] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def _file(self, key: str) -> Path:
        assert self.cache_dir is not None
        return self.cache_dir / key[:2] / f"{key}.json"

    def get(self, key: str) -> Optional[dict]:
        """The stored answer of ``key`` (memory first, then disk), or None; counts a hit or a miss."""
        value = self._memory.get(key)
        if value is not None:
            self._memory.move_to_end(key)
        elif self.cache_dir is not None:
            try:
                loaded = json.loads(self._file(key).read_text())
            except (OSError, ValueError):
                loaded = None
            if isinstance(loaded, dict):
                value = loaded
                self._remember(key, value)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        return value

    def put(self, key: str, value: dict) -> None:
        """Store ``value`` (a JSON object) under ``key``, in memory and on disk."""
        self._remember(key, value)
        if self.cache_dir is not None:
            path = self._file(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(value, f)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

    def _remember(self, key: str, value: dict) -> None:
        if self.max_entries == 0:
            return
        self._memory[key] = value
        self._memory.move_to_end(key)
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)

    def __len__(self) -> int:
        return len(self._memory)
