"""Turn matching: classify each call against its agent's active chain as NEW, APPEND or WIPE.

Two strategies:

- ``messages`` (default, for agents that re-render the whole conversation every call): the
  call APPENDs when its messages start with the previous call's messages followed by the
  assistant message the proxy returned, compared by hashes of canonical message forms (so
  ``None`` vs ``""`` content, tool-call ids and JSON key order do not matter). The token
  prefix is still measured: when messages say APPEND but the prompt tokens do not extend
  the previous prompt + output, the label says so (``token_drift``) and stitching never
  trains across the break. A ``/v1/completions`` call has no messages: tokens decide.
- ``tokens`` (strict): APPEND exactly when the new prompt's token ids start with the previous
  call's prompt + output ids.

Each call is compared with every earlier call of its agent (``match``), not only the last one:
it APPENDs to the one it extends that covers the most, so interleaved conversations and
retries are stitched to the call they continue. A WIPE (no earlier call extended) starts a
new chain; so does an APPEND to a call whose chain already moved on (a branch).
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

from training.openai_api.chat_messages import ChatMessageError, content_text, normalise_message

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
    parent: Optional[int] = None
    """Index of the earlier call this one extends (APPEND), or was compared with (WIPE); None for NEW."""


class TurnCall(Protocol):
    """What matching reads of a call (``training.proxy.CallRecord`` has these and more)."""

    index: int
    agent: str
    label: Optional[TurnLabel]
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
    try:
        return content_text(content, "content") if content is not None else ""
    except ChatMessageError:
        return json.dumps(content, sort_keys=True, default=str)


def canonical_message(message: dict) -> dict:
    """The parts of a chat message that reach the chat template, in one normal form.

    The message goes through the server's own normaliser (``training.openai_api.chat_messages``),
    then keeps role, stripped content, tool calls as (name, decoded arguments) and ``name`` /
    ``reasoning_content``. Dropped: tool-call ids (the server invents them), ``None`` fields
    the SDK adds (``refusal``, ``audio``, ``annotations``, ``function_call``), empty
    ``tool_calls``. A message the normaliser refuses hashes by its raw JSON.
    """
    try:
        m = normalise_message(message)
    except ChatMessageError:
        return {"raw": json.dumps(message, sort_keys=True, default=str)}
    out: dict[str, Any] = {"role": m["role"], "content": m["content"].strip()}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]
        ]
    for key in ("name", "reasoning_content"):
        if m.get(key):
            out[key] = m[key]
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
            return f"context compacted: {len(expected)} messages expected, {len(sent)} sent (first change at index {i})"
        return f"message hash changed at index {i} (role {sent[i].get('role')!r})"
    return None


def classify(
    previous: Optional[TurnCall], call: TurnCall, strategy: str = "messages", previous_name: str = "previous call"
) -> TurnLabel:
    """Label ``call`` against one earlier call ``previous`` (APPEND if it extends it, else WIPE).

    ``previous_name`` words the reason ("previous call", "call 3"). The label's ``chain`` and
    ``parent`` are left for ``assign`` to set.
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
            return TurnLabel(APPEND, f"prompt tokens extend {previous_name}", token_prefix=prefix)
        return TurnLabel(WIPE, f"token prefix broken at position {prefix}", token_prefix=prefix)
    if tools_hash(previous.tools) != tools_hash(call.tools):
        return TurnLabel(WIPE, "tools changed", token_prefix=prefix)
    expected = list(previous.messages) + ([previous.response_message] if previous.response_message else [])
    diff = _message_diff(expected, call.messages)
    if diff is not None:
        return TurnLabel(WIPE, diff, token_prefix=prefix)
    if tokens_extend:
        return TurnLabel(APPEND, f"prompt extends {previous_name}", token_prefix=prefix)
    return TurnLabel(
        APPEND,
        f"prompt extends {previous_name}; re-render drift: token prefix broken at position "
        f"{prefix} of {len(expected_ids)}",
        token_prefix=prefix,
        token_drift=True,
    )


def _extent(call: TurnCall, strategy: str) -> int:
    """How much of a later call's input an APPEND to ``call`` accounts for (messages, or tokens)."""
    if strategy == "messages" and call.messages is not None:
        return len(call.messages) + (1 if call.response_message else 0)
    return len(call.full_ids)


def match(session: Any, call: TurnCall, strategy: str = "messages") -> TurnLabel:
    """Label ``call`` against every earlier call of its agent in ``session``; ``label.parent`` names the match.

    APPEND to the earlier call it extends that covers the most of it (most messages, or most
    tokens for ``strategy="tokens"`` and ``/v1/completions`` calls; then no token drift; then the
    latest), so interleaved conversations and retries under one agent name each extend their own
    call. Otherwise NEW (the agent's first call) or WIPE, with the reason given against the
    agent's latest call.
    """
    earlier = [c for c in session.calls if c.agent == call.agent]
    if not earlier:
        return classify(None, call, strategy)
    latest = earlier[-1].index
    best: Optional[tuple[tuple[int, bool, int], TurnLabel]] = None
    for prev in earlier:
        name = "previous call" if prev.index == latest else f"call {prev.index}"
        label = classify(prev, call, strategy, previous_name=name)
        if label.kind == APPEND:
            key = (_extent(prev, strategy), not label.token_drift, prev.index)
            if best is None or key > best[0]:
                label.parent = prev.index
                best = (key, label)
    if best is not None:
        return best[1]
    label = classify(earlier[-1], call, strategy)
    label.parent = earlier[-1].index
    return label


def assign(session: Any, call: TurnCall, strategy: str = "messages") -> TurnLabel:
    """Label ``call`` within ``session`` (a ``SessionRecord``), number its chain, append it.

    An APPEND to its chain's last call stays on that chain (stitched into the same segment);
    an APPEND to an earlier call (a retry, a branch) starts a new chain whose segment opens with
    this call's prompt, so no generated token is trained twice. NEW and WIPE start a new chain.
    Call under ``session.lock``: the order of calls is the order of this function's calls.
    """
    label = match(session, call, strategy)
    parent_chain = session.calls[label.parent].label.chain if label.kind == APPEND else None
    if parent_chain is not None and session.chain_tail.get(parent_chain) == label.parent:
        label.chain = parent_chain
    else:
        if parent_chain is not None:
            label.reason += f" (a branch: call {session.chain_tail[parent_chain]} already extends it)"
        label.chain = session.next_chain
        session.next_chain += 1
    call.label = label
    call.index = len(session.calls)
    session.calls.append(call)
    session.chain_tail[label.chain] = call.index
    return label
