"""``import_ray``: the one place the launcher imports Ray, with one line naming the extra when it is missing."""

from __future__ import annotations

from typing import Any

MISSING_RAY = "the Ray launcher needs the ray package: pip install 'training[ray]' (the ray extra of this package)"
"""The line a run without Ray prints (``import_ray``)."""


class RayMissingError(ImportError):
    """Ray is not installed; the message is ``MISSING_RAY``."""


def import_ray() -> Any:
    """The ``ray`` module, or ``RayMissingError`` (one line naming the ``ray`` extra) when it is not installed."""
    try:
        import ray
    except ImportError:
        raise RayMissingError(MISSING_RAY) from None
    return ray
