"""Statistics of an evaluation: pass@k (unbiased) and mean reward with a confidence interval.

pass@k for one prompt with ``n`` samples of which ``c`` pass (Chen et al. 2021, unbiased):

    pass@k = 1 - C(n - c, k) / C(n, k)        (1 when n - c < k)

and a task's pass@k is the mean over its prompts. Mean reward's interval is the normal
approximation ``mean ± z * s / sqrt(m)`` over all ``m`` rewards (``s`` the sample standard
deviation, ``z = 1.96`` for 95 %); it is 0 wide for a single reward.
"""

import math
from dataclasses import dataclass
from statistics import NormalDist, fmean, stdev


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n-c, k) / C(n, k)``; needs ``0 <= c <= n`` and ``1 <= k <= n``."""
    if not 1 <= k <= n:
        raise ValueError(f"k: must be in [1, n={n}], got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"c: must be in [0, n={n}], got {c}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(counts: list[tuple[int, int]], k: int) -> float:
    """Mean over prompts of ``pass_at_k(n, c, k)`` for ``(n, c)`` pairs, one per prompt."""
    if not counts:
        raise ValueError("counts: no prompts to score")
    return fmean(pass_at_k(n, c, k) for n, c in counts)


@dataclass(frozen=True)
class MeanInterval:
    """A mean with its normal-approximation confidence interval ``[low, high]`` at ``level``."""

    mean: float
    low: float
    high: float
    level: float


def mean_with_interval(values: list[float], level: float = 0.95) -> MeanInterval:
    """``mean ± z * stdev / sqrt(len)`` with ``z`` the normal quantile of ``(1 + level) / 2``."""
    if not values:
        raise ValueError("values: no rewards to average")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: must be in (0, 1), got {level}")
    mean = fmean(values)
    if len(values) < 2:
        return MeanInterval(mean, mean, mean, level)
    half = NormalDist().inv_cdf((1.0 + level) / 2.0) * stdev(values) / math.sqrt(len(values))
    return MeanInterval(mean, mean - half, mean + half, level)
