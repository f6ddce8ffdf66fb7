"""Calls sampled under constrained decoding, and the one switch that says whether they train.

A constrained call is one whose request forces its output's shape: ``tool_choice`` ``"required"`` or a named
function (a forced tool call), or a ``response_format`` other than ``{"type": "text"}`` (JSON). The server
masks every token the grammar does not allow before sampling, and the logprob it returns is the one under
that masked, renormalised distribution (the distribution that drew the token; engine README,
"Constrained decoding"). Training on such a call is therefore exact (the importance ratio compares the
trainer's unmasked logprob with the masked one the sampler used), but it teaches the policy an output the
grammar, not the policy, chose in part. A recipe decides with ``constrained_calls``:

- ``"exclude"`` (the default): the call's output stays in the episode as context (loss mask 0 when
  stitched) and gives no sample of its own in transitions mode;
- ``"train"``: trained like any other call, with the masked logprobs.

One name and meaning for both kinds of agent: the proxy (``ProxyServer(constrained_calls=...)``, for
black-box agents) and the in-process agents (``TrajectoryEngine`` / ``make_agent_rollout_fn(constrained_calls=...)``).
"""

from __future__ import annotations

from typing import Any, Optional

CONSTRAINED_CALLS = ("exclude", "train")
"""``constrained_calls`` values: keep a constrained call as context only, or train on it."""


def checked_constrained_calls(value: str) -> str:
    """``value`` when it is one of ``CONSTRAINED_CALLS``; else ValueError naming it."""
    if value not in CONSTRAINED_CALLS:
        raise ValueError(f"constrained_calls: {value!r} is not one of {CONSTRAINED_CALLS}")
    return value


def constraint_of(body: dict) -> Optional[dict[str, Any]]:
    """The constraining fields of a request body (a forced ``tool_choice``, a non-text ``response_format``),
    or None for an ordinary sample."""
    out: dict[str, Any] = {}
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        out["tool_choice"] = choice
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        out["response_format"] = fmt
    return out or None


def trains(constraint: Optional[dict], constrained_calls: str) -> bool:
    """Whether a call with ``constraint`` (``constraint_of``) is trained on under ``constrained_calls``."""
    return constraint is None or constrained_calls == "train"
