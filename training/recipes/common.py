"""A second import path of ``RolloutFailureError`` (defined in ``context.py``), so that user code that
imports it from ``training.recipes.common`` works; nothing else lives here.
"""

from training.recipes.context import RolloutFailureError

__all__ = ["RolloutFailureError"]
