"""What the proxy records: one ``CallRecord`` per model call, grouped into ``SessionRecord``s.

A session is one episode of one agent (named by the ``x-multi-turn-session-id`` header or
the ``/sessions/{id}/v1`` URL prefix). Calls are appended in the order their responses
arrive; each gets a ``TurnLabel`` (NEW / APPEND / WIPE and why) from ``turn_matching.match``
(``training/utils/rl/rollout/turn_matching.py``) against every earlier call of the same agent.
Chains are numbered per session:
a NEW or WIPE call starts chain ``k + 1``, an APPEND stays on its chain.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from training.openai_api.responses_store import ResponseStore
from training.utils.rl.rollout.sample_builder import CallTokens, call_weight_versions
from training.utils.rl.rollout.turn_matching import APPEND, NEW, WIPE, TurnLabel

__all__ = ["APPEND", "NEW", "WIPE", "CallRecord", "SessionRecord", "TurnLabel"]

SESSION_RESPONSES = 64
"""Responses API: the responses a session keeps for ``previous_response_id`` (the most recently used)."""
SESSION_RESPONSE_CHARS = 4 * 1024 * 1024
"""... and the characters of their conversations' JSON, summed (``training/openai_api/responses_store.py``)."""


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
    label: Optional[TurnLabel] = None
    posted_rewards: list[float] = field(default_factory=list)
    """Rewards the agent posted for this call (``POST /sessions/{id}/reward``); per-call credit adds them."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """The sampling fields the upstream got (``temperature``, ``top_p`` as forced or sent, ``seed``, ``stop``...;
    ``sampling_policy.sampling_of``)."""
    constraint: Optional[dict[str, Any]] = None
    """Calls sampled under constrained decoding (chat, Responses, completions): the constraining fields (a forced
    ``tool_choice``, a ``response_format``); None for ordinary samples (``constraint_of``,
    ``training/utils/constrained_calls.py``)."""
    trainable: bool = True
    """False for a constrained call when the proxy runs with ``constrained_calls="exclude"``: its output is
    kept as context (loss mask 0), never trained on."""
    token_weight_versions: Optional[list[int]] = None
    """Per output token, the weight version that produced it (in-flight updates mix versions); None when the
    upstream reports only ``weight_version`` (then every token has that one: ``output_weight_versions``)."""

    @property
    def output_weight_versions(self) -> list[int]:
        """The weight version of each output token (``call_weight_versions``: the sample builder's convention)."""
        return call_weight_versions(self.token_weight_versions, self.weight_version, len(self.output_ids))

    def call_tokens(self) -> CallTokens:
        """This call's exact ids, logprobs, weight versions and ``trainable`` flag, as the sample builder takes them."""
        return CallTokens(
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids,
            output_logprobs=self.output_logprobs,
            output_weight_versions=self.output_weight_versions,
            finish_reason=self.finish_reason,
            index=self.index,
            trainable=self.trainable,
        )

    @property
    def full_ids(self) -> list[int]:
        """Prompt followed by output: what the next call of an APPEND chain must start with."""
        return self.prompt_ids + self.output_ids

    def summary(self) -> dict[str, Any]:
        """JSON-able facts for logs and ``RolloutRun.metadata`` (no token lists)."""
        return {
            "index": self.index,
            "agent": self.agent,
            "endpoint": self.endpoint,
            "label": self.label.kind if self.label else None,
            "reason": self.label.reason if self.label else None,
            "chain": self.label.chain if self.label else None,
            "token_prefix": self.label.token_prefix if self.label else None,
            "parent": self.label.parent if self.label else None,
            "token_drift": self.label.token_drift if self.label else False,
            "prompt_tokens": len(self.prompt_ids),
            "output_tokens": len(self.output_ids),
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
            "upstream": self.upstream,
            "cached_tokens": self.cached_tokens,
            "posted_rewards": list(self.posted_rewards),
            "sampling": dict(self.sampling),
            "constraint": self.constraint,
            "trainable": self.trainable,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SessionRecord:
    """Every call of one session, plus what went wrong upstream."""

    session_id: str
    calls: list[CallRecord] = field(default_factory=list)
    upstream_errors: list[str] = field(default_factory=list)
    """One line per call that failed upstream after its retries (the rollout then fails)."""
    deployment_failures: int = 0
    """How many of ``upstream_errors`` were the deployment's (5xx or unreachable past the retries, a stream cut
    off mid-way), not a reply's fault: the recipe rolls such an episode's row out again (``rollout.py``)."""
    seed_base: Optional[int] = None
    """Where the seeds of this episode's calls come from: a call that names no ``seed`` is sent with
    ``derive_seed(seed_base, k)``, k counting such calls (``CallForwarder.stamp_seed``). The proxy rollout sets it
    from the recipe's completion scope (``training/utils/rl/request_seeds.py``), so a call resent after a restart,
    a requeued row and a resumed run draw the same tokens; None (outside a recipe) sends no seed."""
    seeded_calls: int = 0
    """Calls so far that got a derived seed."""
    deployment_lost: Optional[Exception] = None
    """What the sampler raised when a call's server cannot come back (``DeploymentLostError``): the rollout
    re-raises it and the run stops with its reason."""
    aborted_calls: list[str] = field(default_factory=list)
    """One line per call the proxy aborted: a stream the agent stopped reading, a straggler a pre-sync drain
    cancelled (``server.py``). Such a call is not recorded and the rollout fails (never trained)."""
    closed: bool = False
    """A closed session refuses further calls (410): its rollout is over."""
    next_chain: int = 0
    chain_tail: dict[int, int] = field(default_factory=dict)
    """Chain number → index of its last call (an APPEND to it continues the chain)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    in_flight: int = 0
    """Calls of this session the proxy is serving now (such a session is never evicted)."""
    last_active: float = 0.0
    """``time.monotonic()`` of the session's last activity (idle expiry, eviction order)."""
    evicted: Optional[str] = None
    """Why the proxy dropped this session before its rollout closed it (idle expiry, table full), else None."""
    responses: ResponseStore = field(
        default_factory=lambda: ResponseStore(SESSION_RESPONSES, SESSION_RESPONSE_CHARS), repr=False
    )
    """Responses API: this session's stored responses, for ``previous_response_id`` (``responses.py``)."""

    def upstream_failed(self, message: str, *, deployment: bool, lost: Optional[Exception] = None) -> str:
        """Note a call that failed upstream (``deployment``: the deployment's failure, not the reply's); returns
        ``message``."""
        self.upstream_errors.append(message)
        self.deployment_failures += deployment
        if lost is not None:
            self.deployment_lost = lost
        return message

    def calls_of(self, agents: Optional[set[str]] = None) -> list[CallRecord]:
        """The calls of the named agents (all when ``agents`` is None), in order."""
        return [c for c in self.calls if agents is None or c.agent in agents]

    def labels(self) -> list[tuple[str, str]]:
        """``(kind, reason)`` of every call, in order (handy in tests and logs)."""
        return [(c.label.kind, c.label.reason) for c in self.calls if c.label is not None]


def record_from_reply(reply: dict, endpoint: str, body: dict, agent: str, url: str) -> CallRecord:
    """The ``CallRecord`` of one upstream reply (chat or completions, non-streamed shape) to request ``body``.

    Raises ``KeyError`` / ``TypeError`` / ``ValueError`` when the reply lacks token-level detail
    (no ``token_ids``, no ``prompt_token_ids``, logprobs not parallel to the output ids).
    """
    choice = reply["choices"][0]
    prompt_ids = choice.get("prompt_token_ids") or reply["prompt_token_ids"]
    output_ids = list(choice["token_ids"])
    if endpoint == "chat":
        logprobs = [float(e["logprob"]) for e in (choice.get("logprobs") or {}).get("content") or []]
        msg = choice["message"]
        response_message = {"role": "assistant", "content": msg.get("content")}
        for key in ("tool_calls", "reasoning_content"):
            if msg.get(key):
                response_message[key] = msg[key]
    else:
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        response_message = None
    if len(logprobs) != len(output_ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(output_ids)} output tokens")
    usage = reply.get("usage") or {}
    return CallRecord(
        index=-1,
        endpoint=endpoint,
        agent=agent,
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=str(choice.get("finish_reason")),
        weight_version=int(choice.get("weight_version", reply.get("weight_version", -1))),
        upstream=url,
        messages=copy.deepcopy(body.get("messages")) if endpoint == "chat" else None,
        tools=copy.deepcopy(body.get("tools")) if endpoint == "chat" else None,
        response_message=response_message,
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        token_weight_versions=_token_versions(choice, len(output_ids)),
    )


def _token_versions(choice: dict, n: int) -> Optional[list[int]]:
    """The upstream's per-token weight versions when it reports them, one per output token; else None."""
    versions = choice.get("token_weight_versions")
    if versions is None:
        return None
    if len(versions) != n:
        raise ValueError(f"{len(versions)} token_weight_versions for {n} output tokens")
    return [int(v) for v in versions]
