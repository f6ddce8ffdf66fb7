"""Recipe side: train an unmodified agent by pointing it at the proxy.

    make_rollout_fn = make_proxy_rollout_fn(agent_fn, reward_fn=reward_fn, mode="stitch")
    main(cfg, rollout_fn_factory=make_rollout_fn, rows=...)

Per rollout: a fresh session id; ``agent_fn(row, endpoint)`` gets an ``AgentEndpoint``
(``base_url`` = the session's proxy URL, ``api_key``, ``model``) and runs (``async def`` is
awaited, a plain function runs in a worker thread); ``reward_fn(row, result)`` or
``reward_fn(row, result, session)`` scores it; the session's calls become a ``RolloutRun``:
stitched segments (``mode="stitch"``) or one sample per call (``mode="transitions"``), with
every call's label, reason and weight version in ``metadata``.

Failure policy: the agent raising → the sample fails (``AgentFailedError``, counted by the
recipe as an error); an upstream call that failed after its retries → the sample fails
(``UpstreamFailedError``) even if the agent swallowed the error, and when the deployment failed it
(5xx, unreachable, a stream cut off) the recipe rolls the row out again (``is_retryable``); a
server that cannot come back → the sampler's ``DeploymentLostError``, which stops the run. The
proxy's upstream calls wait for a restarting replica and are resent when their server died under
them, by the recipe sampler's rules and retry settings (``upstream.py``); an over-length call or
segment → truncated and masked (see ``server`` and ``stitching``); an episode with no
trainable token → ``None`` (counted as dropped).

The proxy starts lazily on the recipe's event loop at the first rollout (free port on
127.0.0.1). ``await rollout_fn.close()`` stops it (its serve task ends, its port is released, its
agent threads are let go); ``async with rollout_fn:`` starts it and closes it. Otherwise it stops
when that loop shuts down.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from training.proxy.records import APPEND, NEW, WIPE, SessionRecord
from training.proxy.server import AGENT_HEADER, SESSION_HEADER, ProxyServer
from training.proxy.stitching import DRIFT_POLICIES, stitch_calls
from training.proxy.transitions import CreditFn, build_transitions, credit_parts, tool_status_counts
from training.utils.rl.request_seeds import next_request_seed
from training.utils.rl.rollout import RolloutRun, RolloutSetup
from training.utils.rl.rollout.episode_facts import EpisodeFacts
from training.openai_api.template_check import run_template_check

MODES = ("stitch", "transitions")


class AgentFailedError(RuntimeError):
    """The agent function raised, or made no call: this completion fails (the recipe counts it)."""

    failure_cause = "agent"
    """How ``training.utils.rl.groups`` counts it: ``rollout/failed/agent``."""

    def __init__(self, message: str, cause: str = "agent"):
        super().__init__(message)
        self.failure_cause = cause


class UpstreamFailedError(RuntimeError):
    """A call of the episode failed upstream after its retries: this completion fails. ``deployment_failure``: the
    deployment's fault (5xx or unreachable past the retries, a stream cut off), so the recipe requeues the row
    (``training/recipes/context.py``, ``is_retryable``) instead of training the rest of its group."""

    failure_cause = "upstream"

    def __init__(self, message: str, deployment_failure: bool = False):
        super().__init__(message)
        self.deployment_failure = deployment_failure


def session_failure(session: SessionRecord) -> Optional[BaseException]:
    """Why a closed session's episode fails, or None: the sampler's ``DeploymentLostError`` of a server that
    cannot come back (re-raised as is: the run stops), an aborted call (``AgentFailedError``, ``call_aborted``),
    or an upstream failure (``UpstreamFailedError``, a deployment failure when any of them was the deployment's)."""
    if session.deployment_lost is not None:
        return session.deployment_lost
    if session.aborted_calls:
        return AgentFailedError(f"the proxy aborted a call: {session.aborted_calls[-1]}", cause="call_aborted")
    if session.upstream_errors:
        return UpstreamFailedError(
            f"{len(session.upstream_errors)} upstream failure(s): {session.upstream_errors[-1]}",
            deployment_failure=session.deployment_failures > 0,
        )
    return None


@dataclass
class AgentEndpoint:
    """What an agent needs to talk to the policy: pass these to ``openai.OpenAI(...)``."""

    base_url: str
    """The session's own base URL (``http://127.0.0.1:PORT/sessions/ID/v1``)."""
    api_key: str
    model: str
    """Any name works; the proxy serves the policy under it."""
    session_id: str
    headers: dict[str, str] = field(default_factory=dict)
    """Optional: the session header, for clients that prefer ``proxy_base_url`` + header."""

    @property
    def anthropic_base_url(self) -> str:
        """The session URL for the ``anthropic`` SDK, which appends ``/v1/messages`` itself."""
        return self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url


class ProxyRolloutFn:
    """The ``rollout_fn`` built by ``make_proxy_rollout_fn``; ``self.proxy`` is its live proxy.

    An async context manager: ``async with rollout_fn:`` starts the proxy on the running loop and
    ``close()``s it on exit; after ``close()`` the function refuses rollouts (``RuntimeError``).
    """

    def __init__(
        self,
        setup: RolloutSetup,
        agent_fn: Callable,
        reward_fn: Callable,
        *,
        mode: str,
        credit_fn: Optional[CreditFn],
        agents: Optional[set[str]],
        strategy: str,
        on_drift: str,
        upstream_urls: Optional[list[str]],
        max_seq_len: Optional[int],
        model_name: str,
        agent_threads: int,
        proxy_kwargs: dict[str, Any],
        template_check: str = "warn",
        chat_template_kwargs: Optional[dict] = None,
    ):
        self.agent_fn, self.reward_fn = agent_fn, reward_fn
        self.mode, self.credit_fn, self.agents, self.on_drift = mode, credit_fn, agents, on_drift
        self.max_seq_len = max_seq_len if max_seq_len is not None else setup.max_seq_len
        self.model_name = model_name
        sampler = setup.sampler
        urls = upstream_urls or list(getattr(sampler, "base_urls", [sampler.base_url]))
        forced = {k: setup.sampling_kwargs[k] for k in ("temperature", "top_p") if k in setup.sampling_kwargs}
        kw = dict(
            upstream_api_key=getattr(sampler, "api_key", None),
            restarts=sampler if hasattr(sampler, "resend_after_restart") else None,  # the sampler's restart rules
            strategy=strategy,
            forced_params=forced,
            default_max_tokens=setup.sampling_kwargs.get("max_tokens"),
        )
        for name in ("max_retries", "backoff_s"):  # the sampler's retries (DeployConfig.max_retries, retry_backoff_s)
            if isinstance(getattr(sampler, name, None), (int, float)):
                kw[name] = getattr(sampler, name)
        if setup.proxy_config is not None:  # the recipe's Config.proxy deadlines
            kw.update(
                stream_write_timeout_s=setup.proxy_config.stream_write_timeout_s,
                drain_timeout_s=setup.proxy_config.drain_timeout_s,
            )
        kw.update(proxy_kwargs)
        self._make_proxy = lambda: ProxyServer(urls, **kw)
        self.proxy: Optional[ProxyServer] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._host: Optional[asyncio.Task] = None
        self._starting: Optional[asyncio.Lock] = None
        self._closed = False
        self._cancelled_before = 0
        """Drain cancellations of the proxies this function started before its current one."""
        self._threads = ThreadPoolExecutor(max_workers=agent_threads, thread_name_prefix="proxy-agent")
        self._reward_wants_session = len(inspect.signature(reward_fn).parameters) >= 3
        self._hooks = (self.before_weight_sync, self.after_weight_sync)
        self._setup = setup
        setup.weight_sync_hooks.append(self._hooks)
        self.template_checks = run_template_check(
            setup.tokenizer, template_check, where="make_proxy_rollout_fn", **(chat_template_kwargs or {})
        )
        """The template check's result for the policy's tokenizer (before the first rollout)."""

    async def before_weight_sync(self) -> None:
        """Hold new agent calls and wait for in-flight ones, so no call straddles two weight versions; stragglers
        past the proxy's ``drain_timeout_s`` are cancelled and their episodes fail (``ProxyServer.pause_and_drain``)."""
        if self.proxy is not None:
            await self.proxy.pause_and_drain()

    async def after_weight_sync(self) -> None:
        if self.proxy is not None:
            self.proxy.gate.resume()

    @property
    def drain_cancelled_calls(self) -> int:
        """Calls the pre-sync drains cancelled so far, over every proxy this function started (the recipe logs them
        per step as ``rollout/drain_cancelled_calls``)."""
        return self._cancelled_before + (self.proxy.drain_cancelled_calls if self.proxy is not None else 0)

    def _forget_proxy(self) -> None:
        self._cancelled_before = self.drain_cancelled_calls
        self.proxy = None

    async def ensure_started(self) -> ProxyServer:
        """Start the proxy on the running loop (once per loop); it stops at ``close()`` or when the loop shuts down."""
        if self._closed:
            raise RuntimeError("ProxyRolloutFn is closed: build a new one (make_rollout_fn(setup))")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._forget_proxy()
            self._loop, self._starting, self._host = loop, asyncio.Lock(), None
        async with self._starting:
            if self.proxy is None:
                proxy, started = self._make_proxy(), asyncio.Event()
                self._host = asyncio.create_task(self._serve(proxy, started))
                await started.wait()
                if self._host.done():
                    self._host.result()  # re-raise a start failure
                self.proxy = proxy
        return self.proxy

    async def close(self) -> None:
        """Stop the proxy: cancel its serve task and wait for it (the server stops, its port is
        released), let the agent threads go and drop its weight-sync hooks from the setup. Idempotent;
        call it on the loop that started it."""
        host = self._host
        here = host is not None and host.get_loop() is asyncio.get_running_loop()
        if host is not None and not here and not host.done() and not host.get_loop().is_closed():
            raise RuntimeError("close(): the proxy runs on another event loop; close it there")
        self._closed = True
        if self._hooks in self._setup.weight_sync_hooks:
            self._setup.weight_sync_hooks.remove(self._hooks)
        self._host = None
        self._forget_proxy()
        if here and not host.done():
            host.cancel()
            await asyncio.gather(host, return_exceptions=True)
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> "ProxyRolloutFn":
        await self.ensure_started()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @staticmethod
    async def _serve(proxy: ProxyServer, started: asyncio.Event) -> None:
        try:
            async with proxy:
                started.set()
                await asyncio.Event().wait()  # until cancelled (loop shutdown)
        finally:
            started.set()

    async def _run_agent(self, row: dict, endpoint: AgentEndpoint) -> Any:
        if inspect.iscoroutinefunction(self.agent_fn):
            return await self.agent_fn(row, endpoint)
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.agent_fn, row, endpoint)

    async def _reward(self, row: dict, result: Any, session: SessionRecord) -> float:
        args = (row, result, session) if self._reward_wants_session else (row, result)
        value = self.reward_fn(*args)
        if inspect.isawaitable(value):
            value = await value
        return float(value)

    async def __call__(self, row: dict) -> Optional[RolloutRun]:
        proxy = await self.ensure_started()
        sid = f"ep-{uuid.uuid4().hex}"
        proxy.open_session(sid).seed_base = next_request_seed()  # the recipe's completion scope: resends draw alike
        endpoint = AgentEndpoint(
            base_url=proxy.session_url(sid),
            api_key=proxy.session_key(sid) or "none",
            model=self.model_name,
            session_id=sid,
            headers={SESSION_HEADER: sid},
        )
        try:
            result = await self._run_agent(row, endpoint)
        except Exception as e:
            session = proxy.close_session(sid)
            failure = session_failure(session)
            if failure is not None:
                raise failure from e
            raise AgentFailedError(f"agent raised {type(e).__name__}: {e}", cause=f"agent_{type(e).__name__}") from e
        except BaseException:  # cancelled (rollout timeout): later calls of a straggling agent get 410
            proxy.close_session(sid)
            raise
        session = proxy.close_session(sid)
        return await self.episode_result(row, result, session)

    async def episode_result(self, row: dict, result: Any, session: SessionRecord) -> Optional[RolloutRun]:
        """Score a finished session and turn it into a ``RolloutRun`` (None when nothing is trainable).

        Stitch mode: the run's reward is R + sum of the calls' per-call rewards. Transitions: the
        run's reward is R (the group statistics) and each sample's is g·R + i, with
        ``return_weights`` g (``transitions.credit_parts``; formula in ``utils/rl/advantages.py``).
        """
        if session.evicted:
            raise AgentFailedError(f"the proxy dropped the session: {session.evicted}", cause="session_evicted")
        failure = session_failure(session)
        if failure is not None:
            raise failure
        if not session.calls:
            raise AgentFailedError(
                "the agent made no model call through the proxy: does it use the given base_url?", cause="agent_no_call"
            )
        reward = await self._reward(row, result, session)
        calls = session.calls_of(self.agents)
        facts = self.episode_facts(session, calls, reward)
        if self.mode == "stitch":
            _, intermediate = credit_parts(self.credit_fn, calls, reward)
            run_reward = reward + sum(intermediate)
            res = stitch_calls(calls, reward=run_reward, on_drift=self.on_drift, max_seq_len=self.max_seq_len)
            return res.to_run(run_reward, facts, intermediate)
        trainable = [c for c in calls if c.trainable]  # constrained calls under constrained_calls="exclude" drop out
        res = build_transitions(trainable, reward, self.credit_fn, max_seq_len=self.max_seq_len)
        return res.to_run(reward, facts)

    def episode_facts(self, session: SessionRecord, calls: list, reward: float) -> EpisodeFacts:
        """The run's facts (``EpisodeFacts``; the step metrics read them: ``training/utils/rl/run_metrics.py``)."""
        labels = {kind: 0 for kind in (NEW, APPEND, WIPE)}
        for c in calls:
            labels[c.label.kind] += 1
        return EpisodeFacts(
            mode=self.mode,
            stop_reason="finish",  # the agent returned; timeouts and errors count as failure causes
            session_id=session.session_id,
            episode_return=reward,
            calls=[c.summary() for c in session.calls],
            num_calls=len(calls),
            labels=labels,
            drift=sum(1 for c in calls if c.label.token_drift),
            tool_status_counts=tool_status_counts(calls),
            truncated=any(c.finish_reason == "length" for c in calls),
            weight_versions=sorted({c.weight_version for c in calls}),
        )


def make_proxy_rollout_fn(
    agent_fn: Callable[[dict, AgentEndpoint], Any],
    *,
    reward_fn: Callable[..., Any],
    mode: str = "stitch",
    credit_fn: Optional[CreditFn] = None,
    agents: Optional[list[str]] = None,
    strategy: str = "messages",
    on_drift: str = "split",
    upstream_urls: Optional[list[str]] = None,
    max_seq_len: Optional[int] = None,
    model_name: str = "policy",
    agent_threads: int = 64,
    proxy_kwargs: Optional[dict[str, Any]] = None,
    template_check: str = "warn",
    chat_template_kwargs: Optional[dict] = None,
) -> Callable[[RolloutSetup], ProxyRolloutFn]:
    """Build ``make_rollout_fn(setup)`` for ``main(...)`` around an unmodified agent.

    ``agents``: train only the calls of these agent names (``x-agent-name`` header or the
    request's ``user`` field); None trains every call. ``strategy``: ``messages`` or ``tokens``
    turn matching. ``on_drift``: ``split`` or ``mask`` (stitch mode). ``upstream_urls``: replicas
    (default: the recipe's deployment). ``credit_fn``: per-call credit (transitions: each call's
    reward; stitch: only its per-call rewards count, summed into the run's reward).
    ``template_check``: ``warn`` / ``error`` / ``off``, run on the policy's tokenizer when the
    recipe builds the rollout function (``training/openai_api/template_check.py``), with
    ``chat_template_kwargs``.
    """
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    if on_drift not in DRIFT_POLICIES:
        raise ValueError(f"on_drift: {on_drift!r} is not one of {DRIFT_POLICIES}")
    if not callable(agent_fn) or not callable(reward_fn):
        raise TypeError("agent_fn and reward_fn must be callables")
    wanted = set(agents) if agents is not None else None
    if template_check not in ("warn", "error", "off"):
        raise ValueError(f"template_check: {template_check!r} is not one of ('warn', 'error', 'off')")

    def make_rollout_fn(setup: RolloutSetup) -> ProxyRolloutFn:
        return ProxyRolloutFn(
            setup,
            agent_fn,
            reward_fn,
            mode=mode,
            credit_fn=credit_fn,
            agents=wanted,
            strategy=strategy,
            on_drift=on_drift,
            upstream_urls=upstream_urls,
            max_seq_len=max_seq_len,
            model_name=model_name,
            agent_threads=agent_threads,
            proxy_kwargs=dict(proxy_kwargs or {}),
            template_check=template_check,
            chat_template_kwargs=chat_template_kwargs,
        )

    return make_rollout_fn


__all__ = [
    "AGENT_HEADER",
    "AgentEndpoint",
    "AgentFailedError",
    "ProxyRolloutFn",
    "UpstreamFailedError",
    "make_proxy_rollout_fn",
]
