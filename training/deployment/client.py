"""aiohttp client for the deployment: token-in / token-out sampling with logprobs.

``DeploymentSampler`` talks to any server with the vLLM-style RL fields (the embedded server,
vLLM, SGLang): it always asks for ``return_token_ids`` and sampled-token ``logprobs`` and
returns ``Completion`` objects whose ``full_tokens`` are exactly the server's ids.
``prompt_logprobs`` scores given token sequences (vLLM's ``prompt_logprobs`` field): a teacher's
logprob of every token another model sampled, for on-policy distillation.

Failure policy: connection errors and 5xx answers are retried (``max_retries`` times); a 4xx
answer raises ``DeploymentRequestError`` at once with the server's message and field; a request
that exceeds ``timeout_s`` raises ``DeploymentRequestError`` (not retried: the server is busy).

Restarts: a sampler that knows who supervises its servers (``set_readiness``: ``DeploymentGroup`` of
launched servers gives it each replica's ``ReplicaStatus``) never sends to a replica that is
restarting; it waits for the restart to end, the latest weights loaded again, up to the replica's
``budget_s`` (derived from its measured start-up). A request that failed because its server died is
resent once the server is ready, with the same body (the same ``seed``), without spending a retry;
``restart_retries`` counts those (``resend_after_restart``; the proxy's upstream calls follow the same two rules
through ``wait_ready`` and ``resend_after_restart``). A replica that cannot come back (its restarts spent, a restart
failed, or not back within the budget) raises ``DeploymentLostError`` with the reason. Attached
servers have no supervisor here: the plain retries apply.

Replica failover: a replica that refuses connections is marked down for ``down_s`` seconds and
skipped by ``pick_replica``; the failed request is retried at once on a live replica (sessions
pinned to the dead one are re-mapped over the live ones). When every replica is down, or there
is only one, retries wait ``backoff_s * 2**attempt`` between attempts. A down mark expires by
itself: the next request tries the replica again and a success brings it back.
One ``aiohttp.ClientSession`` is created lazily per event loop and shared by every sampler
made with ``with_defaults``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import aiohttp

from training.utils.http import SESSION_HEADER, auth_headers, session_headers
from training.utils.rl.request_seeds import next_request_seed

log = logging.getLogger(__name__)

__all__ = [
    "Completion",
    "DeploymentLostError",
    "DeploymentRequestError",
    "ReplicaStatus",
    "DeploymentSampler",
    "SESSION_HEADER",
    "ScoredTokens",
    "build_deployment_sampler",
]


class DeploymentRequestError(RuntimeError):
    """The deployment refused or failed a request. ``status`` is the HTTP status (None: no answer)."""

    def __init__(self, message: str, *, status: Optional[int] = None, param: Optional[str] = None, url: str = ""):
        super().__init__(f"{url}: HTTP {status}: {message}" if status else f"{url}: {message}")
        self.status = status
        self.param = param
        self.server_message = message


class DeploymentLostError(DeploymentRequestError):
    """A launched server died and cannot come back (its restarts spent, a restart failed, or it was not ready within
    its restart budget). Not a failed completion: the run stops with ``reason``."""

    failure_cause = "deployment_lost"

    def __init__(self, reason: str, *, url: str = ""):
        super().__init__(reason, url=url)
        self.reason = reason


READY_POLL_S = 0.1
"""How often a request waiting for a restarting replica asks its supervisor again."""


@dataclass(frozen=True)
class ReplicaStatus:
    """What the supervisor of a launched replica knows of it (``ServerProcess.status``)."""

    state: str
    """``ready`` (serving), ``restarting`` (dead or coming back: requests wait) or ``failed`` (it cannot come back)."""
    budget_s: float = 0.0
    """How long a request waits for a ``restarting`` replica before it gives up (derived from the measured start-up)."""
    reason: str = ""
    """``failed``: why, in one line; ``restarting``: which restart and where its log is."""


@dataclass
class Completion:
    """One sampled completion: the server's exact token ids and the sampler's logprobs."""

    full_tokens: list[int]
    """Prompt + output ids, exactly as the server saw and produced them."""
    prompt_len: int
    """Number of prompt tokens at the start of ``full_tokens``."""
    inference_logprobs: list[float]
    """Sampler logprob of each output token (one per ``output_tokens`` entry)."""
    finish_reason: str
    """``stop``, ``length``, ``tool_calls`` (chat with tools) or ``abort``."""
    text: str
    """Decoded output (for chat: ``message.content``, the text outside parsed tool-call blocks)."""
    weight_version: int
    """Weight version that produced this completion: the OLDEST one among its tokens."""
    message: Optional[dict] = None
    """Chat only: the OpenAI-style assistant message (``content``, ``tool_calls``)."""
    cached_tokens: int = 0
    """Prompt tokens the server reused from its KV cache (per request, shared by its choices)."""
    token_weight_versions: Optional[list[int]] = None
    """Per output token (parallel to ``output_tokens``): the weight version that produced it, as the
    server reports it (in-flight updates mix versions). A server that reports no version at all
    (vLLM, SGLang) gets the version the request was sent under for every token, the same rule as
    ``weight_version``; None when the server reports a version but not per token."""

    @property
    def output_tokens(self) -> list[int]:
        return self.full_tokens[self.prompt_len :]

    @property
    def prompt_tokens(self) -> list[int]:
        return self.full_tokens[: self.prompt_len]

    @property
    def tool_calls(self) -> list[dict]:
        """Parsed tool calls of a chat completion (empty for plain completions)."""
        return list((self.message or {}).get("tool_calls") or [])


@dataclass
class ScoredTokens:
    """A server's teacher-forced logprobs of one token sequence (``DeploymentSampler.prompt_logprobs``)."""

    token_ids: list[int]
    """The sequence that was scored, as sent."""
    logprobs: list[Optional[float]]
    """Per token: its logprob given the tokens before it (raw logits, no temperature); None at position 0."""
    top_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    """With ``top_k > 0``: per position the likeliest tokens' logprobs (token id -> logprob; the sequence's own token
    included); None at position 0."""
    weight_version: Optional[int] = None
    """The weight version that scored it, when the server reports one (the embedded server does, vLLM does not)."""


def _normalise_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class _HttpClient:
    """One ClientSession per event loop, created on first use, shared by related samplers."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self.in_flight: dict[str, int] = {}
        """Requests in flight per replica URL (shared by related samplers: the load balancer's view)."""
        self.noted_weight_version = 0
        """The newest weight version known to be served everywhere (``note_weight_version``)."""
        self.down_until: dict[str, float] = {}
        """Replica URL -> monotonic time until which it is skipped (it refused a connection)."""
        self.readiness: Optional[Callable[[str], Optional[ReplicaStatus]]] = None
        """Replica URL -> its supervisor's ``ReplicaStatus`` (None: no supervisor; ``set_readiness``)."""
        self.restart_retries = 0
        """Requests resent because their server died under them and came back (``DeploymentSampler.restart_retries``)."""
        self.restart_waits = 0
        """Requests that waited for a restarting server before they were sent (``DeploymentSampler.restart_waits``)."""
        self.waiting_on: set[str] = set()
        """Replicas some request is waiting for (their wait is logged once per restart)."""
        self.replica_urls: list[str] = []
        """The replicas' URLs, one list shared by related samplers (``DeploymentSampler.replace_replica``)."""

    def _drop_dead(self) -> None:
        for loop in [lp for lp in self._sessions if lp.is_closed()]:
            sess = self._sessions.pop(loop)
            connector = sess.connector
            sess.detach()  # its loop is gone: nothing can be awaited; drop sockets without warnings
            if connector is not None:
                try:
                    connector._close()
                except Exception:  # transports of a closed loop may refuse; they die with it
                    pass

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        self._drop_dead()
        sess = self._sessions.get(loop)
        if sess is None or sess.closed:
            sess = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), connector=aiohttp.TCPConnector(limit=0)
            )
            self._sessions[loop] = sess
        return sess

    def __del__(self) -> None:
        try:
            self._drop_dead()
        except Exception:
            pass

    async def close(self) -> None:
        self._drop_dead()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        sess = self._sessions.pop(loop, None)
        if sess is not None and not sess.closed:
            await sess.close()


class DeploymentSampler:
    """Client of one deployment, or of several replicas of it. Sampling kwargs: max_tokens, temperature,
    top_p, stop, seed, ...

    With several URLs a request with a session id always goes to the same replica (a stable hash
    of the id, so its KV cache is reused there); any other request goes to the replica with the
    fewest requests in flight. The id travels as both ``x-multi-turn-session-id`` and
    ``x-session-affinity`` (``training.utils.http.session_headers``).
    """

    def __init__(
        self,
        base_url: Union[str, Sequence[str]],
        *,
        api_key: Optional[str] = None,
        model: Optional[str] = None,
        timeout_s: float = 600.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        down_s: float = 5.0,
        sampling_defaults: Optional[dict] = None,
        _client: Optional[_HttpClient] = None,
    ):
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("base_url: give at least one URL")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"base_url: must start with http:// or https://, got {url!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {max_retries}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.base_urls = [_normalise_url(u) for u in urls] if _client is None else _client.replica_urls
        """Every replica, in the order given (one list shared by every sampler made by ``with_defaults``)."""
        self.api_key = api_key
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.down_s = down_s
        """Seconds a replica that refused a connection is skipped before it is tried again."""
        self.sampling_defaults = dict(sampling_defaults or {})
        self._client = _client or _HttpClient(timeout_s)
        self._client.replica_urls = self.base_urls

    @property
    def base_url(self) -> str:
        """The first replica (the only one, in the common case)."""
        return self.base_urls[0]

    def replace_replica(self, old: str, new: str) -> None:
        """Send from now on to ``new`` what went to replica ``old`` (a replica restarted at another address); it
        keeps its place in the list, so its sessions keep their replica. Every ``with_defaults`` sampler sees it."""
        old, new = _normalise_url(old), _normalise_url(new)
        self.base_urls[:] = [new if u == old else u for u in self.base_urls]

    def with_defaults(self, **sampling: Any) -> "DeploymentSampler":
        """A sampler sharing this one's connections, with ``sampling`` layered over its defaults."""
        return type(self)(
            self.base_urls,
            api_key=self.api_key,
            model=self.model,
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
            backoff_s=self.backoff_s,
            down_s=self.down_s,
            sampling_defaults={**self.sampling_defaults, **sampling},
            _client=self._client,
        )

    async def close(self) -> None:
        """Close this event loop's session (other samplers made by ``with_defaults`` share it)."""
        await self._client.close()

    def note_weight_version(self, version: int) -> None:
        """Record that every replica now serves ``version`` (call after a weight sync has returned).

        A server whose answers carry no ``weight_version`` (vLLM's and SGLang's OpenAI APIs) gets
        its completions labelled with the version noted when the request was *sent*. A sync only
        moves versions forward, so that label is never newer than the weights that produced any
        of the completion's tokens (it may be older: conservative for the off-policy gate).
        Shared with every sampler made by ``with_defaults``.
        """
        self._client.noted_weight_version = int(version)

    def set_readiness(self, readiness: Optional[Callable[[str], Optional[ReplicaStatus]]]) -> None:
        """Give the sampler (and every sampler made by ``with_defaults``) each replica's supervisor: ``readiness(url)``
        says whether it is ready, restarting or lost (see the module docstring). Must not block: it is called on the
        event loop before every request."""
        self._client.readiness = readiness

    @property
    def restart_retries(self) -> int:
        """Requests resent so far because their server died under them and came back (shared by ``with_defaults``)."""
        return self._client.restart_retries

    @property
    def restart_waits(self) -> int:
        """Requests so far that waited for a restarting server before they were sent (shared by ``with_defaults``)."""
        return self._client.restart_waits

    def replica_status(self, url: str) -> Optional[ReplicaStatus]:
        """The supervisor's ``ReplicaStatus`` of ``url``; None without a supervisor (attached servers)."""
        readiness = self._client.readiness
        return readiness(url) if readiness is not None else None

    def _headers(self, session_id: Optional[str]) -> dict[str, str]:
        return auth_headers(self.api_key, session_headers(session_id))

    def live_replicas(self) -> list[str]:
        """Replicas not marked down and not restarting (every replica when none is: someone has to be tried)."""
        now = time.monotonic()
        live = [
            u
            for u in self.base_urls
            if self._client.down_until.get(u, 0.0) <= now and _is_ready(self.replica_status(u))
        ]
        return live or list(self.base_urls)

    def mark_down(self, url: str) -> None:
        """Skip ``url`` for ``down_s`` seconds (it refused a connection)."""
        if len(self.base_urls) > 1 and self._client.down_until.get(url, 0.0) <= time.monotonic():
            log.warning("replica %s is down; sending its requests to the other replicas for %.0f s", url, self.down_s)
        self._client.down_until[url] = time.monotonic() + self.down_s

    def pick_replica(self, session_id: Optional[str]) -> str:
        """The replica for one request: the session's own (stable hash), else the least loaded live one.

        A session whose replica is down is hashed over the live replicas instead (and returns to its
        own replica once that is back).
        """
        if len(self.base_urls) == 1:
            return self.base_url
        live = self.live_replicas()
        if session_id:
            digest = int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big")
            own = self.base_urls[digest % len(self.base_urls)]
            return own if own in live else live[digest % len(live)]
        return min(live, key=lambda u: self._client.in_flight.get(u, 0))

    async def request(
        self,
        method: str,
        path: str,
        body: Optional[dict] = None,
        session_id: Optional[str] = None,
        base_url: Optional[str] = None,
    ) -> dict:
        """Send one JSON request with the retry and failover policy; return the decoded JSON answer.

        ``base_url`` pins the replica (no failover); by default ``pick_replica`` chooses it, again
        for every attempt.
        """
        in_flight = self._client.in_flight
        last: Optional[BaseException] = None
        failed: Optional[str] = None
        attempt, resent = 0, False
        while True:
            base = base_url or self.pick_replica(session_id)
            if attempt and base == failed and not resent:  # no other replica to go to: back off
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            resent = False
            await self.wait_ready(base)
            in_flight[base] = in_flight.get(base, 0) + 1
            try:
                return await self._attempt(method, base + path, body, session_id)
            except aiohttp.ClientConnectionError as e:
                last = e
                self.mark_down(base)
            except DeploymentRequestError as e:
                if e.status is None or e.status < 500:
                    raise
                last = e
            finally:
                in_flight[base] -= 1
            failed = base
            if self.resend_after_restart(base):
                resent = True
                log.warning("deployment %s%s failed as its server died (%s); resent once it is back", base, path, last)
                continue
            attempt += 1
            log.warning("deployment %s%s attempt %d/%d failed: %s", base, path, attempt, self.max_retries + 1, last)
            if attempt > self.max_retries:
                break
        raise DeploymentRequestError(
            f"gave up after {self.max_retries + 1} attempts: {last}",
            url=failed or "",
            status=getattr(last, "status", None),
        ) from last

    def resend_after_restart(self, url: str) -> bool:
        """Whether a request to ``url`` that just failed did so because its server died under it (its supervisor says
        it is not ready): then it is resent, the same body, once ``wait_ready`` returns, without spending a retry, and
        counted in ``restart_retries``. False without a supervisor or while it says ready (the plain retries apply).
        The proxy's upstream pool (``training/proxy/upstream.py``) resends by this rule too."""
        if _is_ready(self.replica_status(url)):
            return False
        self._client.restart_retries += 1
        return True

    async def wait_ready(self, url: str) -> None:
        """Return once ``url``'s supervisor says it is ready (at once without a supervisor or when it is); raise
        ``DeploymentLostError`` when it cannot come back or is not back within its ``budget_s``."""
        status = self.replica_status(url)
        if _is_ready(status):
            return
        t0 = time.monotonic()
        budget = status.budget_s
        self._client.restart_waits += 1
        waiting = self._client.waiting_on
        if url not in waiting:
            waiting.add(url)
            log.warning("%s is restarting (%s): requests wait up to %.0f s for it", url, status.reason, budget)
        while not _is_ready(status):
            if status.state == "failed":
                waiting.discard(url)
                raise DeploymentLostError(status.reason, url=url)
            if time.monotonic() - t0 > budget:
                waiting.discard(url)
                raise DeploymentLostError(
                    f"not ready after {budget:.0f} s of waiting for its restart (the budget derived from its "
                    f"start-up time): {status.reason}",
                    url=url,
                )
            await asyncio.sleep(READY_POLL_S)
            status = self.replica_status(url)
        if url in waiting:
            waiting.discard(url)
            log.info("%s is ready again after %.1f s of waiting", url, time.monotonic() - t0)

    async def _attempt(self, method: str, url: str, body: Optional[dict], session_id: Optional[str]) -> dict:
        """One HTTP exchange: the JSON answer, or ``DeploymentRequestError`` with the status (connection errors pass)."""
        try:
            async with self._client.session().request(
                method, url, json=body, headers=self._headers(session_id)
            ) as resp:
                if resp.status < 400:
                    return await resp.json(content_type=None)
                message, param = _error_message(await resp.text())
                raise DeploymentRequestError(message, status=resp.status, param=param, url=url)
        except asyncio.TimeoutError as e:
            raise DeploymentRequestError(f"no answer within {self.timeout_s} s", url=url) from e

    def _body(self, n: int, sampling: dict) -> dict:
        body = {**self.sampling_defaults, **sampling, "n": n, "return_token_ids": True}
        if body.get("seed") is None:  # inside a recipe's completion: a seed derived from what the request is
            seed = next_request_seed()
            if seed is not None:
                body["seed"] = seed
        if self.model:
            body["model"] = self.model
        return body

    async def sample_with_prompt_tokens(
        self, prompt_ids: list[int], n: int = 1, *, session_id: Optional[str] = None, **sampling: Any
    ) -> list[Completion]:
        """Sample ``n`` completions of a token-id prompt via /v1/completions."""
        if not prompt_ids:
            raise ValueError("prompt_ids: must not be empty")
        body = self._body(n, sampling)
        body["prompt"] = list(prompt_ids)
        if body.get("logprobs") is None:
            body["logprobs"] = 0  # 0 = the sampled tokens' logprobs, no alternatives
        sent_under = self._client.noted_weight_version
        out = await self.request("POST", "/v1/completions", body, session_id)
        cached = _cached(out)
        result = []
        for ch in sorted(out["choices"], key=lambda c: c["index"]):
            prompt = ch.get("prompt_token_ids") or list(prompt_ids)
            lps = (ch.get("logprobs") or {}).get("token_logprobs")
            result.append(_completion(prompt, ch, lps, ch.get("text", ""), out, cached, sent_under=sent_under))
        return result

    async def chat(
        self,
        messages: list[dict],
        n: int = 1,
        *,
        tools: Optional[list[dict]] = None,
        session_id: Optional[str] = None,
        **sampling: Any,
    ) -> list[Completion]:
        """Sample ``n`` chat completions via /v1/chat/completions (template applied by the server)."""
        body = self._body(n, sampling)
        body["messages"] = messages
        body["logprobs"] = True
        if tools:
            body["tools"] = tools
        sent_under = self._client.noted_weight_version
        out = await self.request("POST", "/v1/chat/completions", body, session_id)
        cached = _cached(out)
        result = []
        for ch in sorted(out["choices"], key=lambda c: c["index"]):
            prompt = ch.get("prompt_token_ids") or out.get("prompt_token_ids")
            if prompt is None:
                raise DeploymentRequestError(
                    "the server returned no prompt_token_ids (needs return_token_ids)", url=self.base_url
                )
            content = (ch.get("logprobs") or {}).get("content")
            lps = None if content is None else [c["logprob"] for c in content]
            msg = ch.get("message") or {}
            result.append(
                _completion(prompt, ch, lps, msg.get("content") or "", out, cached, message=msg, sent_under=sent_under)
            )
        return result

    async def prompt_logprobs(
        self,
        sequences: list[list[int]],
        *,
        top_k: int = 0,
        max_tokens: int = 1,
        temperature: float = 1.0,
        session_id: Optional[str] = None,
    ) -> list[ScoredTokens]:
        """Score token sequences through ``/v1/completions``' ``prompt_logprobs`` (all in one request).

        Works against vLLM and the embedded server alike: the answer is vLLM's ``choices[].prompt_logprobs``
        (per token a dict keyed by token id of ``{"logprob", "rank", "decoded_token"}``, None first).
        ``max_tokens``: vLLM needs >= 1 (one token is generated and dropped); the embedded server also takes
        0, which only scores. ``temperature``: the embedded server scores softmax(logits / temperature) (a
        distillation teacher is asked at the student's sampling temperature); vLLM's prompt logprobs are raw
        whatever it is (it only sets the one generated token's sampling). Raises ``DeploymentRequestError`` when the answer lacks a sequence's entries."""
        if not sequences or any(not s for s in sequences):
            raise ValueError("sequences: give at least one non-empty token sequence")
        body: dict[str, Any] = {
            "prompt": [list(s) for s in sequences],
            "prompt_logprobs": top_k,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "n": 1,
        }
        if self.model:
            body["model"] = self.model
        out = await self.request("POST", "/v1/completions", body, session_id)
        choices = sorted(out.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != len(sequences):
            raise DeploymentRequestError(
                f"the server returned {len(choices)} choices for {len(sequences)} scored sequences", url=self.base_url
            )
        return [_scored(seq, ch, out, self.base_url, top_k > 0) for seq, ch in zip(sequences, choices)]

    async def health(self) -> dict:
        """GET /health of the first replica."""
        return await self.request("GET", "/health", base_url=self.base_url)

    async def weight_version(self) -> int:
        """The weight version served now (the oldest one when replicas differ)."""
        versions = await asyncio.gather(*(self.request("GET", "/weight_version", base_url=u) for u in self.base_urls))
        return min(int(v["weight_version"]) for v in versions)


def _is_ready(status: Optional[ReplicaStatus]) -> bool:
    """True without a supervisor's word (None) or when it says ``ready``."""
    return status is None or status.state == "ready"


def _error_message(text: str) -> tuple[str, Optional[str]]:
    import json

    try:
        err = json.loads(text).get("error", {})
        if isinstance(err, dict):
            return str(err.get("message", text)), err.get("param")
        return str(err), None
    except (ValueError, AttributeError):
        return text[:2000], None


def _cached(out: dict) -> int:
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _completion(
    prompt: list[int],
    ch: dict,
    lps: Optional[list[float]],
    text: str,
    out: dict,
    cached: int,
    message: Optional[dict] = None,
    sent_under: int = 0,
) -> Completion:
    """One choice as a ``Completion``; ``sent_under`` labels it when the server reports no version."""
    tokens = ch.get("token_ids")
    if tokens is None:
        raise DeploymentRequestError("the server returned no token_ids (needs return_token_ids support)")
    if lps is None or len(lps) != len(tokens):
        raise DeploymentRequestError(
            f"the server returned {0 if lps is None else len(lps)} logprobs for {len(tokens)} tokens"
        )
    version = ch.get("weight_version", out.get("weight_version"))
    per_token = ch.get("token_weight_versions")
    if per_token is not None:
        if len(per_token) != len(tokens):
            raise DeploymentRequestError(
                f"the server returned {len(per_token)} token_weight_versions for {len(tokens)} tokens"
            )
        per_token = [int(v) for v in per_token]
    elif version is None:
        per_token = [sent_under] * len(tokens)
    return Completion(
        full_tokens=list(prompt) + list(tokens),
        prompt_len=len(prompt),
        inference_logprobs=[float(x) for x in lps],
        finish_reason=ch.get("finish_reason") or "stop",
        text=text,
        weight_version=sent_under if version is None else int(version),
        message=message,
        cached_tokens=cached,
        token_weight_versions=per_token,
    )


def _scored(seq: list[int], choice: dict, out: dict, url: str, with_top: bool) -> ScoredTokens:
    """One choice's vLLM-shaped ``prompt_logprobs`` as ``ScoredTokens`` of ``seq``."""
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(seq):
        got = len(entries) if isinstance(entries, list) else "no"
        raise DeploymentRequestError(
            f"the server returned {got} prompt_logprobs entries for a sequence of {len(seq)} tokens", url=url
        )
    logprobs: list[Optional[float]] = [None]
    top: list[Optional[dict[int, float]]] = [None]
    for t in range(1, len(seq)):
        entry = entries[t] or {}
        mine = entry.get(str(seq[t]), entry.get(seq[t]))
        if not isinstance(mine, dict) or "logprob" not in mine:
            raise DeploymentRequestError(f"prompt_logprobs[{t}] has no entry for token {seq[t]}", url=url)
        logprobs.append(float(mine["logprob"]))
        top.append({int(k): float(v["logprob"]) for k, v in entry.items()})
    version = choice.get("weight_version", out.get("weight_version"))
    return ScoredTokens(list(seq), logprobs, top if with_top else None, None if version is None else int(version))


def build_deployment_sampler(setup: Any) -> DeploymentSampler:
    """The sampler a rollout function uses: ``setup.sampler`` with the recipe's sampling defaults."""
    return setup.sampler.with_defaults(**setup.sampling_kwargs)
