"""Transitions: every call is its own sample (its prompt, mask 0, then its output, mask 1).

A credit function spreads the episode return over the calls:
``credit_fn(calls, episode_return) -> list[float]`` (one reward per call, same order).

- ``same_return`` (default): every call gets the return.
- ``discounted(gamma)``: call k of K gets ``return * gamma**(K - 1 - k)``.
- ``with_tool_status(base, failed_call=-0.1, unparsable_call=-0.1)``: ``base`` plus an
  intermediate reward per call derived from tool status: ``failed_call`` for each of the
  call's tool calls whose result (a later ``role: tool`` message with its ``tool_call_id``)
  reports an error, ``unparsable_call`` when the output holds a ``<tool_call>`` block that the
  server could not parse into ``tool_calls``.

Rollout-level normalisation: ``episode_weights(n)`` gives each of an episode's ``n`` samples
the weight ``1 / n`` so that every episode counts once, however many calls it made. The
weight is set on each ``RolloutSample.weight``, which scales that sample's loss.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Optional

from training.proxy.records import CallRecord
from training.utils.rl.rollout import RolloutSample

CreditFn = Callable[[list[CallRecord], float], list[float]]
_ERROR_RE = re.compile(r"^\s*(error|exception|traceback)\b|\"error\"\s*:", re.IGNORECASE)


def same_return(calls: list[CallRecord], episode_return: float) -> list[float]:
    """Every call gets the episode's return."""
    return [float(episode_return)] * len(calls)


def discounted(gamma: float) -> CreditFn:
    """Later calls get more of the return: call k of K gets ``return * gamma**(K - 1 - k)``."""
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma: {gamma} must be in (0, 1]")

    def credit(calls: list[CallRecord], episode_return: float) -> list[float]:
        k = len(calls)
        return [float(episode_return) * gamma ** (k - 1 - i) for i in range(k)]
    return credit


def tool_result_is_error(content: object) -> bool:
    """A tool result reports an error: text starting with error/exception, or JSON with an ``error`` key."""
    text = content if isinstance(content, str) else json.dumps(content, default=str)
    return bool(_ERROR_RE.search(text or ""))


def tool_status_rewards(calls: list[CallRecord], all_calls: list[CallRecord], *, failed_call: float = -0.1,
                        unparsable_call: float = -0.1) -> list[float]:
    """Intermediate reward per call of ``calls`` from tool status seen anywhere in ``all_calls``."""
    results: dict[str, object] = {}
    for c in all_calls:
        for m in c.messages or []:
            if m.get("role") == "tool" and m.get("tool_call_id"):
                results[m["tool_call_id"]] = m.get("content")
    out = []
    for c in calls:
        r = 0.0
        msg = c.response_message or {}
        for tc in msg.get("tool_calls") or []:
            if tc.get("id") in results and tool_result_is_error(results[tc["id"]]):
                r += failed_call
        if "<tool_call>" in (msg.get("content") or ""):
            r += unparsable_call
        out.append(r)
    return out


def with_tool_status(base: CreditFn = same_return, *, failed_call: float = -0.1,
                     unparsable_call: float = -0.1) -> CreditFn:
    """``base`` credit plus intermediate rewards from tool status (see ``tool_status_rewards``)."""

    def credit(calls: list[CallRecord], episode_return: float) -> list[float]:
        extra = tool_status_rewards(calls, calls, failed_call=failed_call, unparsable_call=unparsable_call)
        return [b + e for b, e in zip(base(calls, episode_return), extra)]
    return credit


def episode_weights(n: int) -> list[float]:
    """Rollout-level normalisation: ``n`` samples of one episode each weigh ``1 / n``."""
    return [1.0 / n] * n if n else []


@dataclass
class TransitionResult:
    samples: list[RolloutSample]
    rewards: list[float]
    """Credited reward of each sample (parallel to ``samples``)."""
    calls: list[int]
    """Call index of each sample."""
    weights: list[float]
    """``episode_weights(len(samples))``."""


def build_transitions(calls: list[CallRecord], episode_return: float, credit_fn: Optional[CreditFn] = None, *,
                      max_seq_len: Optional[int] = None) -> TransitionResult:
    """One sample per call with an output token; rewards from ``credit_fn`` (default ``same_return``)."""
    credit_fn = credit_fn or same_return
    rewards = credit_fn(calls, episode_return)
    if len(rewards) != len(calls):
        raise ValueError(f"credit_fn returned {len(rewards)} rewards for {len(calls)} calls")
    samples, kept_rewards, kept_calls = [], [], []
    for c, r in zip(calls, rewards):
        tokens = c.prompt_ids + c.output_ids
        mask = [0] * len(c.prompt_ids) + [1] * len(c.output_ids)
        logprobs = [0.0] * len(c.prompt_ids) + list(c.output_logprobs)
        versions = c.output_weight_versions
        finish = c.finish_reason
        if max_seq_len is not None and len(tokens) > max_seq_len:
            tokens, mask, logprobs, finish = tokens[:max_seq_len], mask[:max_seq_len], logprobs[:max_seq_len], "length"
            versions = versions[:sum(mask)]
        if sum(mask) == 0:
            continue
        samples.append(RolloutSample(tokens=tokens, logprobs=logprobs, loss_mask=mask, reward=float(r),
                                     finish_reason=finish,
                                     token_weight_versions=versions if all(v >= 0 for v in versions) else None))
        kept_rewards.append(float(r))
        kept_calls.append(c.index)
    weights = episode_weights(len(samples))
    for sample, weight in zip(samples, weights):
        sample.weight = weight
    return TransitionResult(samples, kept_rewards, kept_calls, weights)
