"""Per-call credit and transitions, shared by in-process agents and the proxy.

An episode of K model calls can train per call ("transitions"): each call becomes its own
sample (its exact prompt ids, mask 0, then its exact output ids, mask 1), rewarded

    r_k = g_k·R + i_k

with R the episode return, g_k the share of it credited to call k and i_k its per-call
(intermediate) reward, e.g. AIR from tool status. A credit function
``credit_fn(calls, R) -> list[float]`` (one reward per call, any call type: only ``len(calls)``
matters to the built-in ones) must be affine in R; ``credit_parts`` reads g_k = r_k(1) - r_k(0)
and i_k = r_k(0) and refuses one that is not.

- ``same_return`` (default): g_k = 1, i_k = 0.
- ``discounted(gamma)``: call k of K gets g_k = gamma**(K - 1 - k).

Rollout-level normalisation: ``episode_weights(n)`` gives each of an episode's ``n`` samples the
weight ``1 / n`` (``RolloutSample.weight``); the PPO loop normalises the loss by the weighted
token count, so an episode trains as hard in transitions mode as its one stitched sample does.
The group's advantage of call k is g_k·Â_episode + (i_k - mean i): ``advantages.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from training.utils.rl.rollout import RolloutRun, RolloutSample
from training.utils.rl.rollout.episode_facts import EpisodeFacts
from training.utils.rl.rollout.sample_builder import CallTokens, SampleBuilder

__all__ = [
    "TRANSITIONS",
    "CallTokens",
    "CreditFn",
    "TransitionResult",
    "credit_parts",
    "discounted",
    "episode_weights",
    "same_return",
    "transitions_of",
]

CreditFn = Callable[[Sequence[Any], float], list[float]]
"""``credit_fn(calls, R) -> [r_0, ..., r_{K-1}]``, affine in R."""

TRANSITIONS = "transitions"
"""The name of the per-call mode (``mode="transitions"`` in ``training.agents`` and ``training.proxy``)."""


def same_return(calls: Sequence[Any], episode_return: float) -> list[float]:
    """Every call gets the episode's return."""
    return [float(episode_return)] * len(calls)


def discounted(gamma: float) -> CreditFn:
    """Later calls get more of the return: call k of K gets ``return * gamma**(K - 1 - k)``."""
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma: {gamma} must be in (0, 1]")

    def credit(calls: Sequence[Any], episode_return: float) -> list[float]:
        k = len(calls)
        return [float(episode_return) * gamma ** (k - 1 - i) for i in range(k)]

    return credit


def credit_parts(
    credit_fn: Optional[CreditFn],
    calls: Sequence[Any],
    episode_return: float,
    extra: Optional[Sequence[float]] = None,
) -> tuple[list[float], list[float]]:
    """(g, i): each call's share of the return and its per-call reward, plus ``extra[k]`` when given
    (rewards known per call outside ``credit_fn``: tool-status AIR, rewards an agent posted).

    Raises ``ValueError`` when ``credit_fn`` returns the wrong number of rewards or is not affine in R.
    """
    credit_fn = credit_fn or same_return
    at0, at1, at_r = (list(credit_fn(calls, r)) for r in (0.0, 1.0, float(episode_return)))
    for got in (at0, at1, at_r):
        if len(got) != len(calls):
            raise ValueError(f"credit_fn returned {len(got)} rewards for {len(calls)} calls")
    if extra is not None and len(extra) != len(calls):
        raise ValueError(f"extra: {len(extra)} per-call rewards for {len(calls)} calls")
    shares = [b - a for a, b in zip(at0, at1)]
    for k, (g, i, r) in enumerate(zip(shares, at0, at_r)):
        if not math.isclose(g * episode_return + i, r, rel_tol=1e-6, abs_tol=1e-6):
            raise ValueError(
                f"credit_fn is not affine in the return: call {k} gets {r} at R={episode_return}, "
                f"but {i} at R=0 and {i + g} at R=1"
            )
    intermediate = [i + float(e) for i, e in zip(at0, extra if extra is not None else [0.0] * len(calls))]
    return shares, intermediate


def episode_weights(n: int) -> list[float]:
    """Rollout-level normalisation: ``n`` samples of one episode each weigh ``1 / n``."""
    return [1.0 / n] * n if n else []


@dataclass
class TransitionResult:
    """Transitions of one episode: the samples and, parallel to them, what credited each."""

    samples: list[RolloutSample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Credited reward of each sample: g·R + i."""
    calls: list[int] = field(default_factory=list)
    """Call index of each sample."""
    weights: list[float] = field(default_factory=list)
    """``episode_weights(len(samples))``."""
    return_weights: list[float] = field(default_factory=list)
    """g of each sample: its share of the episode return (``RolloutRun.return_weights``)."""
    intermediate: list[float] = field(default_factory=list)
    """i of each sample: its per-call reward (tool status, posted rewards)."""

    def to_run(self, episode_return: float, facts: Optional[EpisodeFacts] = None) -> Optional[RolloutRun]:
        """The ``RolloutRun`` (``segment_rewards``, ``return_weights`` g; reward R for the group
        statistics), or None when no call has a trainable token. Its metadata is ``facts`` with the
        credit filled in: ``mode``, ``sample_calls``, ``credited_rewards``, ``sample_weights``,
        ``return_weights``, ``intermediate_rewards`` (per sample) and ``run_reward`` (R)."""
        if not self.samples:
            return None
        facts = replace(
            facts or EpisodeFacts(),
            mode=TRANSITIONS,
            sample_calls=list(self.calls),
            credited_rewards=list(self.rewards),
            sample_weights=list(self.weights),
            return_weights=list(self.return_weights),
            intermediate_rewards=list(self.intermediate),
            run_reward=float(episode_return),
        )
        return RolloutRun(
            segments=self.samples,
            reward=float(episode_return),
            metadata=facts.to_metadata(),
            segment_rewards=True,
            return_weights=self.return_weights,
        )


def transitions_of(
    calls: Sequence[CallTokens],
    shares: Sequence[float],
    intermediate: Sequence[float],
    episode_return: float,
    *,
    max_seq_len: Optional[int] = None,
) -> TransitionResult:
    """One sample per call with a trainable output token (``SampleBuilder.of_call``): ``prompt_ids`` (mask 0)
    + ``output_ids`` (mask 1, the sampler's logprobs and weight versions), reward g·R + i, weight ``1 / n``.
    A call longer than ``max_seq_len`` is cut to it (``finish_reason="length"``); a call with no output
    token left is skipped."""
    result = TransitionResult()
    for c, g, i in zip(calls, shares, intermediate):
        reward = g * float(episode_return) + i
        sample = SampleBuilder.of_call(c).to_sample(reward, max_seq_len=max_seq_len)
        if sample is None:
            continue
        result.samples.append(sample)
        result.rewards.append(reward)
        result.calls.append(c.index)
        result.return_weights.append(g)
        result.intermediate.append(i)
    result.weights = episode_weights(len(result.samples))
    for sample, weight in zip(result.samples, result.weights):
        sample.weight = weight
    return result
