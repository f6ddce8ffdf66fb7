"""What the proxy records: one ``CallRecord`` per model call, grouped into ``SessionRecord``s.

A session is one episode of one agent (named by the ``x-multi-turn-session-id`` header or
the ``/sessions/{id}/v1`` URL prefix). Calls are appended in the order their responses
arrive; each gets a ``TurnLabel`` (NEW / APPEND / WIPE and why) from ``turn_matching.classify``
(``training/utils/rl/rollout/turn_matching.py``)
against the last call of the same agent's active chain. Chains are numbered per session:
a NEW or WIPE call starts chain ``k + 1``, an APPEND stays on its chain.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from training.utils.rl.rollout.turn_matching import APPEND, NEW, WIPE, TurnLabel

__all__ = ["APPEND", "NEW", "WIPE", "CallRecord", "SessionRecord", "TurnLabel"]

@dataclass
class CallRecord:
    """One model call as the upstream served it: exact token ids, never re-tokenized text."""

    index: int
    """Position of the call in its session (order of arrival of the responses)."""
    endpoint: str
    """``chat`` or ``completions``."""
    agent: str
    """Agent / role name (``x-agent-name`` header, else the body's ``user`` field, else ``default``)."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    """Sampler logprob of each output token (parallel to ``output_ids``)."""
    finish_reason: str
    weight_version: int
    upstream: str
    """Base URL of the deployment replica that served the call."""
    messages: Optional[list[dict]] = None
    """Chat calls: the request's messages as sent by the agent."""
    tools: Optional[list[dict]] = None
    response_message: Optional[dict] = None
    """Chat calls: the assistant message returned to the agent (with ``tool_calls``)."""
    cached_tokens: int = 0
    max_tokens_clamped: bool = False
    """True when the agent's ``max_tokens`` did not fit the context and was dropped (over-length policy)."""
    label: Optional[TurnLabel] = None

    @property
    def full_ids(self) -> list[int]:
        """Prompt followed by output: what the next call of an APPEND chain must start with."""
        return self.prompt_ids + self.output_ids

    def summary(self) -> dict[str, Any]:
        """JSON-able facts for logs and ``RolloutRun.metadata`` (no token lists)."""
        return {"index": self.index, "agent": self.agent, "endpoint": self.endpoint,
                "label": self.label.kind if self.label else None, "reason": self.label.reason if self.label else None,
                "chain": self.label.chain if self.label else None,
                "token_prefix": self.label.token_prefix if self.label else None,
                "prompt_tokens": len(self.prompt_ids), "output_tokens": len(self.output_ids),
                "finish_reason": self.finish_reason, "weight_version": self.weight_version,
                "upstream": self.upstream, "cached_tokens": self.cached_tokens,
                "max_tokens_clamped": self.max_tokens_clamped}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SessionRecord:
    """Every call of one session, plus what went wrong upstream."""

    session_id: str
    calls: list[CallRecord] = field(default_factory=list)
    upstream_errors: list[str] = field(default_factory=list)
    """One line per call that failed upstream after its retries (the rollout then fails)."""
    closed: bool = False
    """A closed session refuses further calls (410): its rollout is over."""
    next_chain: int = 0
    active_call: dict[str, int] = field(default_factory=dict)
    """Agent name → index of the last call of its active chain."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def calls_of(self, agents: Optional[set[str]] = None) -> list[CallRecord]:
        """The calls of the named agents (all when ``agents`` is None), in order."""
        return [c for c in self.calls if agents is None or c.agent in agents]

    def labels(self) -> list[tuple[str, str]]:
        """``(kind, reason)`` of every call, in order (handy in tests and logs)."""
        return [(c.label.kind, c.label.reason) for c in self.calls if c.label is not None]
