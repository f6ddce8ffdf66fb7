"""Turn matching: classify each model call of an agent against its active chain as NEW, APPEND or WIPE.

    from training.utils.rl.rollout.turn_matching import classify, APPEND, WIPE

Pure logic, used by the recording proxy (``training/proxy/``) and by any rollout that records
calls itself. A call is anything with ``prompt_ids``, ``full_ids`` (prompt + output ids),
``messages``, ``tools`` and ``response_message`` (``training.proxy.CallRecord`` is one).

Two strategies:

- ``messages`` (default, for agents that re-render the whole conversation every call): the
  call APPENDs when its messages start with the previous call's messages followed by the
  assistant message the model returned, compared by hashes of canonical message forms (so
  ``None`` vs ``""`` content, tool-call ids and JSON key order do not matter). The token
  prefix is still measured: when messages say APPEND but the prompt tokens do not extend
  the previous prompt + output, the label says so (``token_drift``) and stitching never
  trains across the break. A ``/v1/completions`` call has no messages: tokens decide.
- ``tokens`` (strict): APPEND exactly when the new prompt's token ids start with the previous
  call's prompt + output ids.

A WIPE freezes the chain (stitching turns it into its own segment) and starts a new one.
Reasons name the cause: "message hash changed at index 3", "thinking stripped at index 2",
"context compacted: 7 messages expected, 3 sent", "tools changed",
"token prefix broken at position 57".
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Protocol

NEW, APPEND, WIPE = "NEW", "APPEND", "WIPE"


@dataclass
class TurnLabel:
    """How one call relates to its agent's active chain."""

    kind: str
    """``NEW`` (first call of its agent in the session), ``APPEND`` (extends the chain), ``WIPE`` (new chain)."""
    reason: str
    """Why, in words: "prompt extends previous call", "message hash changed at index 3", ..."""
    chain: int = 0
    """Index of the chain (within the session) the call belongs to."""
    token_prefix: Optional[int] = None
    """Tokens of the new prompt that equal the previous call's prompt + output (None for NEW)."""
    token_drift: bool = False
    """True when messages say APPEND but the tokens do not extend (re-render drift)."""


class TurnCall(Protocol):
    """What classification reads of a call (``training.proxy.CallRecord`` has these and more)."""

    prompt_ids: list[int]
    messages: Optional[list[dict]]
    tools: Optional[list[dict]]
    response_message: Optional[dict]

    @property
    def full_ids(self) -> list[int]: ...


STRATEGIES = ("messages", "tokens")
_THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` agree."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _canonical_args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def canonical_message(message: dict) -> dict:
    """The parts of a chat message that reach the chat template, in one normal form.

    Dropped: tool-call ids (the proxy invents them), ``None`` fields the SDK adds
    (``refusal``, ``audio``, ``annotations``, ``function_call``), empty ``tool_calls``.
    """
    out: dict[str, Any] = {"role": message.get("role"), "content": _content_text(message.get("content")).strip()}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [{"name": (c.get("function") or {}).get("name"),
                              "arguments": _canonical_args((c.get("function") or {}).get("arguments"))}
                             for c in calls]
    for key in ("name", "reasoning_content"):
        if message.get(key):
            out[key] = message[key]
    return out


def message_hash(message: dict) -> str:
    """A short stable hash of ``canonical_message(message)``."""
    blob = json.dumps(canonical_message(message), sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tools_hash(tools: Optional[list[dict]]) -> str:
    return hashlib.sha256(json.dumps(tools or [], sort_keys=True, default=str).encode()).hexdigest()[:16]


def _strip_thinking(message: dict) -> dict:
    m = dict(message)
    m["content"] = _THINK_RE.sub("", _content_text(m.get("content")))
    m.pop("reasoning_content", None)
    return m


def _message_diff(expected: list[dict], sent: list[dict]) -> Optional[str]:
    """None when ``sent`` starts with ``expected``; otherwise the reason it does not."""
    for i, exp in enumerate(expected):
        if i >= len(sent):
            return f"context compacted: {len(expected)} messages expected, {len(sent)} sent"
        if message_hash(exp) == message_hash(sent[i]):
            continue
        if exp.get("role") == "assistant" and message_hash(_strip_thinking(exp)) == message_hash(sent[i]):
            return f"thinking stripped at index {i}"
        if len(sent) < len(expected):
            return f"context compacted: {len(expected)} messages expected, {len(sent)} sent " \
                   f"(first change at index {i})"
        return f"message hash changed at index {i} (role {sent[i].get('role')!r})"
    return None


def classify(previous: Optional[TurnCall], call: TurnCall, strategy: str = "messages") -> TurnLabel:
    """Label ``call`` against ``previous``, the last call of its agent's active chain.

    The returned label's ``chain`` is left at 0: the session assigns chain numbers.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: {strategy!r} is not one of {STRATEGIES}")
    if previous is None:
        return TurnLabel(NEW, "first call of this agent in the session")
    expected_ids = previous.full_ids
    prefix = common_prefix_len(expected_ids, call.prompt_ids)
    tokens_extend = prefix == len(expected_ids)
    use_messages = strategy == "messages" and previous.messages is not None and call.messages is not None
    if not use_messages:
        if tokens_extend:
            return TurnLabel(APPEND, "prompt tokens extend previous call", token_prefix=prefix)
        return TurnLabel(WIPE, f"token prefix broken at position {prefix}", token_prefix=prefix)
    if tools_hash(previous.tools) != tools_hash(call.tools):
        return TurnLabel(WIPE, "tools changed", token_prefix=prefix)
    expected = list(previous.messages) + ([previous.response_message] if previous.response_message else [])
    diff = _message_diff(expected, call.messages)
    if diff is not None:
        return TurnLabel(WIPE, diff, token_prefix=prefix)
    if tokens_extend:
        return TurnLabel(APPEND, "prompt extends previous call", token_prefix=prefix)
    return TurnLabel(APPEND, f"prompt extends previous call; re-render drift: token prefix broken at position "
                             f"{prefix} of {len(expected_ids)}", token_prefix=prefix, token_drift=True)


def assign(session: Any, call: Any, strategy: str = "messages") -> TurnLabel:
    """Classify ``call`` within ``session``, number its chain, append it.

    ``session`` has ``calls`` (list), ``active_call`` (agent name → index of its chain's last call) and
    ``next_chain`` (int), as the proxy's ``SessionRecord``; ``call`` has ``agent``, ``label`` and ``index``.

    Call under ``session.lock``: the order of calls is the order of this function's calls.
    """
    prev_index = session.active_call.get(call.agent)
    previous = session.calls[prev_index] if prev_index is not None else None
    label = classify(previous, call, strategy)
    if label.kind == APPEND:
        label.chain = previous.label.chain
    else:
        label.chain = session.next_chain
        session.next_chain += 1
    call.label = label
    call.index = len(session.calls)
    session.calls.append(call)
    session.active_call[call.agent] = call.index
    return label
