"""Advantage estimators: each sample's reward compared with a baseline, chosen by ``Config.advantage`` from the
registry ``ADVANTAGE_ESTIMATORS`` (name → ``AdvantageEstimator``). Per prompt group of G surviving completions
with returns R (std unbiased, divides by G - 1):

    grpo          A_i = (R_i - mean_G R) / (std_G R + 1e-4)            (the default)
    dr_grpo       A_i = R_i - mean_G R                                  (Dr. GRPO: mean-centred only)
    rloo          A_i = R_i - (sum_{j != i} R_j) / (G - 1)  =  G/(G-1) · (R_i - mean_G R)
    reinforce_pp  A_i = (R_i - mean_G R) / (std_B c + 1e-4)             (REINFORCE++ with the group baseline)
    gae           A_i = R_i, the return; the trainer's critic turns it into per-token GAE advantages (``gae.py``)

where for ``reinforce_pp`` c = R - mean_G R is taken over every sample of the step's batch B (``batch_normalised``:
``step_advantages.set_step_advantages`` divides after the groups are centred; the batch mean of c is 0, so the batch
only sets the scale). A zero-variance group (all rewards equal) gets A = 0 under every estimator: it carries no
learning signal (a dynamic filter may drop it; which groups those are does not depend on the estimator), except
under ``gae`` (a ``critic`` estimator: no group baseline, the value head is the baseline and still learns from such
a group, so every sample keeps its own return r_s, per-call credit included). grpo
up-weights groups whose rewards barely differ; dr_grpo and rloo keep the reward's units (rloo's baseline excludes
the sample itself, so it is unbiased); reinforce_pp shares one scale across the step's groups. A group needs at
least two samples: set ``completions_per_prompt >= 2``.

Per-call credit (``credited_advantages``; a ``RolloutRun`` with ``segment_rewards``, e.g. the
transitions of ``training.agents`` and ``training.proxy``, ``credit.py``): sample s of completion c has its own reward r_s = g_s·R_c + i_s, where
R_c is the completion's return, g_s the share of it credited to this call (1, or gamma**(K-1-k)
for discounted credit: ``RolloutRun.return_weights``) and i_s = r_s - g_s·R_c its per-call
(intermediate) reward: tool-status penalties (AIR), rewards the agent posted. Then

    A_s = g_s · Â_c + (i_s - mean over the group's samples of i)
    Â_c = the estimator's A_c of the completion's return (grpo: (R_c - mean_G R) / (std_G R + 1e-4), 0 for a
          zero-variance group)

The return term is discounted together with its baseline (g_s·(R_c - mean R)), so a call of a
successful run never gets a negative return advantage for being early; the per-call term is
centred on the group's mean per-call reward and left in reward units, so it survives a group
whose returns are all equal (an all-failed group still learns which call broke). A sample
without per-call credit has g = 1 and i = 0, so it gets Â_c exactly. Under ``reinforce_pp`` the whole A_s (both
terms) is then divided by the step batch's std.

Distillation reads the result as its task advantage Â (``distillation.py``); a sample's own ``token_advantages`` are
kept as given by every estimator (and left out of ``reinforce_pp``'s batch statistics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

STD_EPSILON = 1e-4
"""Added to the group std before dividing (TRL's value): large enough that a group whose rewards differ only by
float noise (a gap of 1e-7) gets advantages near 0 rather than ±1.25, small enough not to change a real spread
(a 0/1 group's std is ≥ 0.35: its advantages move by < 3e-4 relative)."""


@dataclass(frozen=True)
class AdvantageEstimator:
    """One advantage estimator, as the registry knows it."""

    name: str
    """The ``Config.advantage`` value that selects it."""
    fn: Callable[[list[float]], list[float]]
    """Group returns ``rewards_G`` (checked, not all equal) → each completion's advantage (module docstring)."""
    batch_normalised: bool = False
    """Whether the step's advantages are then divided by their std over the whole step batch (``reinforce_pp``)."""
    critic: bool = False
    """Whether a learned value function gives the advantages (``gae``): the scalar each sample gets is its return
    r_s, the value target, which the trainer turns into per-token advantages (``training/utils/rl/gae.py``)."""


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
"""Registered estimator names → ``AdvantageEstimator``, filled by ``@register_estimator`` below."""


def register_estimator(
    name: str, *, batch_normalised: bool = False, critic: bool = False
) -> Callable[[Callable], Callable]:
    """Decorator: add a group advantage function to ``ADVANTAGE_ESTIMATORS`` under ``name`` (once)."""

    def register(fn: Callable) -> Callable:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage: estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(name, fn, batch_normalised, critic)
        return fn

    return register


def _mean(rewards_G: list[float]) -> float:
    return math.fsum(rewards_G) / len(rewards_G)


def _std(rewards_G: list[float]) -> float:
    mean = _mean(rewards_G)
    return math.sqrt(math.fsum((float(r) - mean) ** 2 for r in rewards_G) / (len(rewards_G) - 1))


@register_estimator("grpo")
def grpo_advantages(rewards_G: list[float]) -> list[float]:
    """A_i = (R_i - mean_G R) / (std_G R + 1e-4), std unbiased."""
    mean, scale = _mean(rewards_G), 1.0 / (_std(rewards_G) + STD_EPSILON)
    return [(float(r) - mean) * scale for r in rewards_G]


@register_estimator("dr_grpo")
def dr_grpo_advantages(rewards_G: list[float]) -> list[float]:
    """A_i = R_i - mean_G R (Dr. GRPO: no std scaling)."""
    mean = _mean(rewards_G)
    return [float(r) - mean for r in rewards_G]


@register_estimator("rloo")
def rloo_advantages(rewards_G: list[float]) -> list[float]:
    """A_i = R_i - (sum_{j != i} R_j) / (G - 1): the leave-one-out baseline (= G/(G-1) · (R_i - mean_G R))."""
    total, others = math.fsum(rewards_G), len(rewards_G) - 1
    return [float(r) - (total - float(r)) / others for r in rewards_G]


@register_estimator("reinforce_pp", batch_normalised=True)
def reinforce_pp_advantages(rewards_G: list[float]) -> list[float]:
    """c_i = R_i - mean_G R; the step then divides every c by (std over the step batch + 1e-4) (module docstring)."""
    return dr_grpo_advantages(rewards_G)


@register_estimator("gae", critic=True)
def gae_returns(rewards_G: list[float]) -> list[float]:
    """A_i = R_i: each completion's return, which the critic's GAE turns into per-token advantages (``gae.py``)."""
    return [float(r) for r in rewards_G]


def estimator_of(estimator: Union[str, bool]) -> AdvantageEstimator:
    """The registered estimator for a name, or for the legacy switch ``scale_by_std`` (True = ``grpo``, False =
    ``dr_grpo``). An unknown name raises ``ValueError`` naming ``advantage``."""
    if isinstance(estimator, bool):
        estimator = "grpo" if estimator else "dr_grpo"
    try:
        return ADVANTAGE_ESTIMATORS[estimator]
    except (KeyError, TypeError):
        raise ValueError(
            f"advantage: unknown estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None


def batch_scale(values_B: list[float]) -> float:
    """reinforce_pp's factor 1 / (std_B + 1e-4) over a step's scalar advantages (unbiased std; 1.0 for fewer than
    two values or a zero spread, so that a batch of zeros stays zeros)."""
    if len(values_B) < 2 or max(values_B) == min(values_B):
        return 1.0
    return 1.0 / (_std(values_B) + STD_EPSILON)


def _check_group(rewards_G: list[float]) -> None:
    size = len(rewards_G)
    if size < 2:
        raise ValueError(
            f"rewards_G: a group of {size} sample(s) cannot be normalised; "
            "completions_per_prompt must be >= 2 (and at least two samples of a group must survive)"
        )
    for i, reward in enumerate(rewards_G):
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"rewards_G: rewards_G[{i}]={reward!r} is not a finite number")


def group_advantages(
    rewards_G: list[float], scale_by_std: Union[bool, str] = True, targets: list[float] | None = None
) -> list[float]:
    """Advantages of one prompt group's samples, in the order of ``rewards_G``, before any batch normalisation.

    ``scale_by_std``: an estimator name (``ADVANTAGE_ESTIMATORS``), or the legacy switch (True = ``grpo``, False =
    ``dr_grpo``). With ``targets`` (``grpo`` / ``dr_grpo`` only), returns ``(target - mean_G R) / (std_G R + 1e-4)``
    (or ``target - mean_G R``) for each target instead, normalised by the statistics of ``rewards_G``; a
    zero-variance group still gives 0. Raises ``ValueError`` for a group of fewer than two samples, a non-finite
    reward, or ``targets`` with another estimator.
    """
    estimator = estimator_of(scale_by_std)
    _check_group(rewards_G)
    values = rewards_G if targets is None else targets
    if max(rewards_G) == min(rewards_G) and not (estimator.critic and targets is None):
        return [0.0] * len(values)
    if targets is None:
        return estimator.fn(rewards_G)
    if estimator.name not in ("grpo", "dr_grpo"):
        raise ValueError(f"targets: only the grpo and dr_grpo estimators score targets, not {estimator.name!r}")
    mean = _mean(rewards_G)
    scale = 1.0 / (_std(rewards_G) + STD_EPSILON) if estimator.name == "grpo" else 1.0
    return [(float(v) - mean) * scale for v in values]


def credited_advantages(
    rewards_G: list[float],
    completion_S: list[int],
    rewards_S: list[float],
    return_weights_S: list[float],
    scale_by_std: Union[bool, str] = True,
) -> list[float]:
    """Per-sample advantages with per-call credit (the formula in the module docstring), before any batch
    normalisation; ``scale_by_std`` names the estimator as in ``group_advantages``.

    ``rewards_G``: each completion's return R_c; ``completion_S[s]``: the position in ``rewards_G``
    of sample s's completion; ``rewards_S[s]``: its own reward r_s; ``return_weights_S[s]``: g_s.
    """
    if not len(completion_S) == len(rewards_S) == len(return_weights_S):
        raise ValueError(
            f"completion_S, rewards_S, return_weights_S: lengths {len(completion_S)}, "
            f"{len(rewards_S)}, {len(return_weights_S)} differ"
        )
    episode_G = group_advantages(rewards_G, scale_by_std)
    calls_S = [float(r) - g * float(rewards_G[c]) for c, r, g in zip(completion_S, rewards_S, return_weights_S)]
    for s, value in enumerate(calls_S):
        if not math.isfinite(value):
            raise ValueError(f"rewards_S: rewards_S[{s}]={rewards_S[s]!r} is not a finite number")
    if estimator_of(scale_by_std).critic:  # the value target: the sample's own reward, r_s = g_s·R_c + i_s
        return [float(r) for r in rewards_S]
    mean_call = math.fsum(calls_S) / len(calls_S) if calls_S else 0.0
    return [g * episode_G[c] + (i - mean_call) for c, g, i in zip(completion_S, return_weights_S, calls_S)]
