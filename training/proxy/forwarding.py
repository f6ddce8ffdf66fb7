"""One agent call forwarded to the upstream and recorded: what every model route of the proxy shares.

``CallForwarder`` holds the forwarding policy (the recipe's forced sampling fields, the default
``max_tokens``, the turn-matching strategy, whether constrained calls train, how ``stream: true`` reaches the
upstream) and does what a route asks of it:

| operation | what it does |
| --- | --- |
| ``stamp_seed(session, body)`` | a call naming no ``seed`` gets the session's next derived one (``SessionRecord.seed_base``), so a resend draws the same tokens |
| ``upstream_body(body, endpoint)`` | the body sent upstream: token ids and logprobs on, the agent's ``model`` and stream fields dropped, the forced fields set, ``max_tokens`` added when the agent sets none |
| ``exchange(request, session, endpoint, body)`` | forward one call without streaming, record and label it |
| ``commit(session, reply, endpoint, body, request, url)`` | record and label a reply that arrived another way (a relayed stream, accumulated) |
| ``relays(url)`` / ``stream_refused(url, status, param)`` | whether a ``stream: true`` call to ``url`` is relayed; an upstream's refusal of ``stream`` noted (``auto``: synthesised from then on) |

The chat and completions routes and the Anthropic Messages route (``server.py``) and the Responses route
(``responses.py``) all go through it, so a call is recorded the same whatever API the agent speaks.
"""

from __future__ import annotations

from typing import Any, Optional

from aiohttp import web

from training.openai_api.errors import error_response
from training.proxy import sampling_policy
from training.proxy.records import CallRecord, SessionRecord, record_from_reply
from training.proxy.upstream import UpstreamError, UpstreamPool
from training.utils.http import session_headers
from training.utils.rl.request_seeds import derive_seed
from training.utils.rl.rollout.turn_matching import STRATEGIES, assign

AGENT_HEADER = "x-agent-name"
"""The header naming the agent of a call (else the body's ``user``, else ``default``): chains are per agent."""
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
UPSTREAM_STREAM_MODES = ("auto", "on", "off")


def upstream_path(endpoint: str) -> str:
    """The upstream route of an endpoint (``chat`` or ``completions``)."""
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def label_headers(record: CallRecord) -> dict[str, str]:
    """The response headers that tell the agent how its call was labelled (``x-proxy-call-label`` / ``-index``)."""
    return {"x-proxy-call-label": record.label.kind, "x-proxy-call-index": str(record.index)}


class CallForwarder:
    """Forwards, records and labels the calls of every session (module docstring); one per ``ProxyServer``."""

    def __init__(
        self,
        pool: UpstreamPool,
        *,
        strategy: str,
        forced_params: Optional[dict[str, Any]],
        default_max_tokens: Optional[int],
        upstream_stream: str,
        constrained_calls: str,
    ):
        """Arguments as ``ProxyServer`` takes them (its docstring); ``ValueError`` names a bad one."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: {strategy!r} is not one of {STRATEGIES}")
        if upstream_stream not in UPSTREAM_STREAM_MODES:
            raise ValueError(f"upstream_stream: {upstream_stream!r} is not one of {UPSTREAM_STREAM_MODES}")
        self.constrained_calls = sampling_policy.checked_constrained_calls(constrained_calls)
        self.pool = pool
        self.strategy = strategy
        self.forced_params = dict(forced_params or {})
        self.default_max_tokens = default_max_tokens
        self.upstream_stream = upstream_stream
        self.refused_stream: set[str] = set()
        """Upstream base URLs that answered ``stream`` with a 400 (their streams are synthesised)."""

    @staticmethod
    def stamp_seed(session: SessionRecord, body: dict) -> None:
        """Give ``body`` (the agent's call, before it is forwarded) ``seed = derive_seed(session.seed_base, k)`` for
        the session's k-th call that names none; nothing without a ``seed_base`` or when the agent set a seed."""
        if session.seed_base is None or body.get("seed") is not None:
            return
        body["seed"] = derive_seed(session.seed_base, session.seeded_calls)
        session.seeded_calls += 1

    def upstream_body(self, body: dict, endpoint: str) -> dict:
        """The body forwarded upstream for the agent's ``body`` (a new dict; ``stream`` is the caller's to add)."""
        fwd = dict(body)
        fwd.pop("model", None)  # the upstream serves one policy; the agent's model name is echoed back
        fwd.pop("stream", None)
        fwd.pop("stream_options", None)
        fwd["return_token_ids"] = True
        if endpoint == "chat":
            fwd["logprobs"] = True
        else:
            fwd["logprobs"] = body.get("logprobs") or 0
        fwd.update(self.forced_params)
        if self.default_max_tokens is not None and not any(body.get(k) for k in MAX_TOKEN_FIELDS):
            fwd["max_tokens"] = self.default_max_tokens
        return fwd

    async def exchange(
        self, request: web.Request, session: SessionRecord, endpoint: str, body: dict
    ) -> "tuple[dict, CallRecord] | web.Response":
        """Forward one call without streaming, record and label it: (upstream reply, record), or the error response
        for the agent (a 502 after the retries, the session's upstream error noted; an upstream 4xx as it came,
        unrecorded and never retried without the refused field)."""
        sid = session.session_id
        url = self.pool.pick(sid)
        try:
            reply = await self.pool.request(
                "POST", url, upstream_path(endpoint), self.upstream_body(body, endpoint), headers=session_headers(sid)
            )
        except UpstreamError as e:
            session.upstream_failed(str(e), deployment=True, lost=e.lost)
            return error_response(502, f"upstream failed: {e}", "upstream_error")
        if reply.status != 200:  # a 4xx names the agent's bad field: never retried without it
            return web.json_response(reply.body, status=reply.status)
        record = await self.commit(session, reply.body, endpoint, body, request, url)
        if record is None:
            return error_response(502, session.upstream_errors[-1], "upstream_error")
        return reply.body, record

    async def commit(
        self,
        session: SessionRecord,
        reply: dict,
        endpoint: str,
        body: dict,
        request: web.Request,
        url: str,
    ) -> Optional[CallRecord]:
        """Record and label one upstream ``reply`` to the agent's ``body`` (sent to ``url``); None (and the session's
        upstream error noted) when it lacks token-level detail."""
        try:
            agent = request.headers.get(AGENT_HEADER) or body.get("user") or "default"
            record = record_from_reply(reply, endpoint, body, str(agent), url)
            sampling_policy.flag(record, self.upstream_body(body, endpoint), body, self.constrained_calls)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            session.upstream_failed(
                f"upstream response lacks token-level detail ({type(e).__name__}: {e})", deployment=False
            )
            return None
        async with session.lock:
            assign(session, record, self.strategy)
        return record

    def relays(self, url: str) -> bool:
        """Whether a ``stream: true`` call to ``url`` is relayed from the upstream's stream (else synthesised)."""
        return self.upstream_stream == "on" or (self.upstream_stream == "auto" and url not in self.refused_stream)

    def stream_refused(self, url: str, status: int, param: Any) -> bool:
        """True when the upstream's answer (``status``, the error's ``param``) refuses ``stream`` and ``auto`` falls
        back: ``url`` is noted, and this call and every later one to it are synthesised instead."""
        if status == 400 and param == "stream" and self.upstream_stream == "auto":
            self.refused_stream.add(url)
            return True
        return False
