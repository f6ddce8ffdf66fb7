"""The old home of ``RolloutFailureError``, kept so that ``from training.recipes.common import
RolloutFailureError`` goes on working. It now lives in ``context.py``; the rest of what this module
held is in ``run.py``, ``context.py``, ``train_state.py`` and ``step_metrics.py``.
"""

from training.recipes.context import RolloutFailureError

__all__ = ["RolloutFailureError"]
