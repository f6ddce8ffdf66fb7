"""Per-call credit, and transitions: every call is its own sample (its prompt, mask 0, then its output, mask 1).

A credit function spreads the episode return R over the calls:
``credit_fn(calls, R) -> list[float]`` (one reward per call, same order). It must be affine in R:
r_k(R) = g_k·R + i_k, where g_k is the share of the return credited to call k and i_k its
per-call (intermediate) reward; ``credit_parts`` reads g_k = r_k(1) - r_k(0) and i_k = r_k(0)
and checks r_k(R) against them. Rewards the agent posted for a call
(``POST /sessions/{id}/reward``, ``CallRecord.posted_rewards``) add to i_k.

- ``same_return`` (default): g_k = 1, i_k = 0.
- ``discounted(gamma)``: call k of K gets g_k = gamma**(K - 1 - k).
- ``with_tool_status(base, failed_call=-0.1, unparsable_call=-0.1)``: ``base`` plus i_k from tool
  status (AIR): ``failed_call`` for each of the call's tool calls whose result (a later
  ``role: tool`` message with its ``tool_call_id``) reports an error, ``unparsable_call`` when
  the output holds a ``<tool_call>`` block the server could not parse into ``tool_calls``.

Tool status (``tool_result_status``) comes from the structure of the result first: a JSON
object is an error when it has a non-empty ``error``, ``ok: false`` / ``success: false``,
``is_error: true`` or a ``status`` of ``error`` / ``failed`` / ``timeout``, and is ``ok``
otherwise (``{"error": null}`` is ok). Only plain text falls back to a pattern: it starts with
``error`` / ``exception`` / ``traceback`` or an exception name (``ValueError: ...``).

In transitions mode the group's advantage of call k is g_k·Â_episode + (i_k - mean i) (see
``training/utils/rl/advantages.py``): the return's share is discounted with its baseline, and
per-call rewards survive a group of equal returns. In stitch mode a segment trains several
calls at once, so the per-call rewards are summed into the run's reward: R + sum_k i_k.

Rollout-level normalisation: ``episode_weights(n)`` gives each of an episode's ``n`` samples
the weight ``1 / n`` (``RolloutSample.weight``); the PPO loop normalises the loss by the weighted
token count, so an episode counts as much in transitions mode as its one stitched sample does.

The mechanism (``same_return``, ``discounted``, the affine check, one sample per call, the
weights) is ``training/utils/rl/credit.py``, shared with ``training.agents``; this module adds
what only recorded calls have: tool status read from ``role: tool`` messages, posted rewards.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Optional

from training.proxy.records import CallRecord
from training.utils.rl import credit
from training.utils.rl.credit import TransitionResult, discounted, episode_weights, same_return

__all__ = [
    "CreditFn",
    "TransitionResult",
    "build_transitions",
    "credit_parts",
    "discounted",
    "episode_weights",
    "same_return",
    "tool_result_is_error",
    "tool_result_status",
    "tool_status_counts",
    "tool_status_rewards",
    "with_tool_status",
]

CreditFn = Callable[[list[CallRecord], float], list[float]]
OK, ERROR = "ok", "error"
_ERROR_TEXT_RE = re.compile(r"^\s*((error|exception|traceback)\b|\w*(error|exception)\s*:)", re.IGNORECASE)
_ERROR_STATUSES = {"error", "failed", "failure", "fail", "timeout", "timed_out"}


def _structured(content: Any) -> Any:
    """The tool result as data: decoded JSON where it is JSON text, the text of content parts otherwise."""
    if isinstance(content, list):
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if isinstance(content, str):
        text = content.strip()
        if text[:1] in ("{", "["):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return content
    return content


def tool_result_status(content: Any) -> str:
    """``error`` or ``ok`` for one tool result: from its JSON structure, else from its text (module docstring)."""
    data = _structured(content)
    if isinstance(data, dict):
        if data.get("error") not in (None, False, "", [], {}):
            return ERROR
        if data.get("ok") is False or data.get("success") is False or data.get("is_error") is True:
            return ERROR
        status = data.get("status")
        return ERROR if isinstance(status, str) and status.strip().lower() in _ERROR_STATUSES else OK
    if isinstance(data, str):
        return ERROR if _ERROR_TEXT_RE.match(data) else OK
    return OK


def tool_result_is_error(content: object) -> bool:
    """``tool_result_status(content) == "error"``."""
    return tool_result_status(content) == ERROR


def _tool_results(all_calls: list[CallRecord]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for c in all_calls:
        for m in c.messages or []:
            if m.get("role") == "tool" and m.get("tool_call_id"):
                results[m["tool_call_id"]] = m.get("content")
    return results


def tool_status_counts(calls: list[CallRecord]) -> dict[str, int]:
    """How the episode's tool calls went: ``ok`` / ``error`` per call whose result came back, ``no_result``
    for a call the agent never answered, ``unparsable`` per output with an unparsed ``<tool_call>`` block."""
    results = _tool_results(calls)
    counts: dict[str, int] = {}
    for c in calls:
        msg = c.response_message or {}
        for tc in msg.get("tool_calls") or []:
            status = tool_result_status(results[tc["id"]]) if tc.get("id") in results else "no_result"
            counts[status] = counts.get(status, 0) + 1
        if "<tool_call>" in (msg.get("content") or ""):
            counts["unparsable"] = counts.get("unparsable", 0) + 1
    return counts


def tool_status_rewards(
    calls: list[CallRecord], all_calls: list[CallRecord], *, failed_call: float = -0.1, unparsable_call: float = -0.1
) -> list[float]:
    """Intermediate reward per call of ``calls`` from tool status seen anywhere in ``all_calls``."""
    results = _tool_results(all_calls)
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


def with_tool_status(
    base: CreditFn = same_return, *, failed_call: float = -0.1, unparsable_call: float = -0.1
) -> CreditFn:
    """``base`` credit plus intermediate rewards from tool status (see ``tool_status_rewards``)."""

    def credit(calls: list[CallRecord], episode_return: float) -> list[float]:
        extra = tool_status_rewards(calls, calls, failed_call=failed_call, unparsable_call=unparsable_call)
        return [b + e for b, e in zip(base(calls, episode_return), extra)]

    return credit


def credit_parts(
    credit_fn: Optional[CreditFn], calls: list[CallRecord], episode_return: float
) -> tuple[list[float], list[float]]:
    """(g, i): each call's share of the return and its per-call reward (posted rewards included).

    Raises ``ValueError`` when ``credit_fn`` returns the wrong number of rewards or is not affine in R.
    """
    posted = [math.fsum(c.posted_rewards) for c in calls]
    return credit.credit_parts(credit_fn, calls, episode_return, extra=posted)


def build_transitions(
    calls: list[CallRecord],
    episode_return: float,
    credit_fn: Optional[CreditFn] = None,
    *,
    max_seq_len: Optional[int] = None,
) -> TransitionResult:
    """One sample per call with a trainable output token (a call flagged ``trainable=False`` gives none);
    rewards g·R + i from ``credit_parts``; built by the shared sample builder (``credit.transitions_of``)."""
    shares, intermediate = credit_parts(credit_fn, calls, episode_return)
    tokens = [c.call_tokens() for c in calls]
    return credit.transitions_of(tokens, shares, intermediate, episode_return, max_seq_len=max_seq_len)
