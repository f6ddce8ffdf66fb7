"""``JudgeConfig`` and ``JudgeClient``: the judge's endpoint, with its own concurrency limit, cache, timeouts,
retries and clock.

The endpoint is either
- **any OpenAI-compatible server** (``base_url`` + ``model`` + ``api_key``): a hosted model, a vLLM server, an
  embedded server started by hand; requests go to ``<base_url>/v1/chat/completions``;
- **a second embedded server on a local model** (``base_url`` None; ``model`` a short name, hub id or folder),
  launched with ``deployment``'s settings on first use (or ``start()``), on 127.0.0.1 with a random API key, and
  stopped by ``close()`` (or at exit), as the recipe starts its distillation teacher.

One judgement is one chat request: ``temperature`` (0 by default), ``max_tokens``, a ``seed`` derived from the
request's content (``derive_seed(seed, content key, attempt)``: the same content gets the same seed in any run) and,
with ``structured_output``, ``response_format`` ``json_schema`` (constrained decoding on the embedded server and on
vLLM, structured outputs on OpenAI), so the answer is the schema's JSON. Answers are cached by the content key of the
request without its seed (``cache.py``); a hit sends nothing.

Failure policy, per request: at most ``max_concurrency`` requests in flight; each attempt times out after
``timeout_s``; a timeout, a lost connection, a 429 or a 5xx, and an answer that does not parse, are retried up to
``max_retries`` times (``backoff_s * 2**attempt`` apart; a retry after an unparsable answer draws a new seed); any
other 4xx, or the last failed attempt, raises ``JudgeError`` (``failure_cause`` ``judge``), which marks the group.

``take_metrics()`` (once per step, by the recipe) returns the ``judge/*`` counters since the last call and
``judge/time_share``: the share of the wall time since the last call during which at least one judge request was
in flight (in ``rl_loop`` the step waits for all of it; in ``async_rl_loop`` it may overlap training).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

import aiohttp

from training.deployment.client import DeploymentRequestError, DeploymentSampler
from training.rewards.cache import JudgeCache, content_key
from training.rewards.judge_prompt import JudgeParseError
from training.utils.config import ConfigError, DeployConfig
from training.utils.rl.group_reward import GroupRewardError
from training.utils.rl.request_seeds import derive_seed

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_STATUSES = frozenset({408, 409, 429})
"""4xx answers that are worth another attempt (besides every 5xx)."""


class JudgeError(GroupRewardError):
    """The judge gave no usable answer for a group (after its retries); the recipe drops the group and counts it
    under ``rollout/failed/judge``."""

    def __init__(self, message: str):
        super().__init__(message, failure_cause="judge")


@dataclass
class JudgeConfig:
    """Where the judge runs and how it is asked (module docstring)."""

    model: str
    """With ``base_url``: the model name sent in each request (``gpt-4o-mini``, the vLLM server's served name). Without:
    the local model the judge server loads (``tiny``, ``smollm2``, a hub id or a folder)."""
    base_url: Optional[str] = None
    """An OpenAI-compatible endpoint (``https://api.openai.com/v1``, ``http://127.0.0.1:8000``); None = launch an
    embedded server on ``model``."""
    api_key: Optional[str] = None
    """The endpoint's key (sent as ``Authorization: Bearer``); a launched server gets a random one."""
    deployment: DeployConfig = field(default_factory=DeployConfig)
    """Settings of the launched judge server (``engine_config``: ``max_model_len``, ``num_threads``, ``device``...;
    ``log_file``); unused with ``base_url``."""
    max_concurrency: int = 4
    """Judge requests in flight at once."""
    timeout_s: float = 120.0
    """Seconds one attempt may take."""
    max_retries: int = 2
    """Attempts after the first (timeouts, lost connections, 429 / 5xx, unparsable answers)."""
    backoff_s: float = 1.0
    """Wait before retry ``i`` (0-based): ``backoff_s * 2**i``."""
    temperature: float = 0.0
    """Sampling temperature of the judge (0: greedy)."""
    max_tokens: int = 1024
    """Longest answer, in tokens."""
    seed: int = 0
    """Base of every request's seed (with the request's content)."""
    structured_output: bool = True
    """Send ``response_format`` ``json_schema`` (the answer's schema): constrained decoding makes the answer parse."""
    score_min: int = 0
    score_max: int = 10
    """The integer score range the judge is asked for."""
    reason_max_chars: Optional[int] = 200
    """Longest reason the schema allows (None: unbounded, for endpoints whose strict mode refuses ``maxLength``)."""
    member_max_chars: int = 2000
    """A member's text is cut to this many characters in the prompt."""
    cache_entries: int = 10_000
    """Answers kept in memory (0: none)."""
    cache_dir: Optional[str] = None
    """Also keep every answer as a JSON file here (survives restarts; None: memory only)."""

    def __post_init__(self):
        def check(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"judge.{name}: {msg}")

        check(isinstance(self.model, str) and self.model != "", "model", "must name the judge model")
        check(
            self.base_url is None
            or (isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://"))),
            "base_url",
            f"must start with http:// or https://, got {self.base_url!r}",
        )
        check(isinstance(self.deployment, DeployConfig), "deployment", "must be a DeployConfig")
        check(self.max_concurrency >= 1, "max_concurrency", f"must be >= 1, got {self.max_concurrency}")
        check(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")
        check(self.max_retries >= 0, "max_retries", f"must be >= 0, got {self.max_retries}")
        check(self.backoff_s >= 0, "backoff_s", f"must be >= 0, got {self.backoff_s}")
        check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        check(self.score_min < self.score_max, "score_max", f"must be > score_min ({self.score_min})")
        check(self.score_max - self.score_min <= 100, "score_max", "the score range must span at most 100 integers")
        check(
            self.reason_max_chars is None or self.reason_max_chars >= 1,
            "reason_max_chars",
            f"must be >= 1 or None, got {self.reason_max_chars}",
        )
        check(self.member_max_chars >= 1, "member_max_chars", f"must be >= 1, got {self.member_max_chars}")
        check(self.cache_entries >= 0, "cache_entries", f"must be >= 0, got {self.cache_entries}")


@dataclass
class JudgeAnswer:
    """One judgement: the request sent (without its seed), the raw answer text, what ``parse`` made of it."""

    key: str
    """Content key of the request (the cache key)."""
    request: dict
    raw: str
    parsed: Any
    cached: bool
    seconds: float
    """Wall time of this judgement (0 for a cache hit)."""
    attempts: int


class BusyClock:
    """Seconds during which at least one request was in flight."""

    def __init__(self):
        self.in_flight = 0
        self.total = 0.0
        self._since = 0.0

    def start(self) -> None:
        if self.in_flight == 0:
            self._since = time.perf_counter()
        self.in_flight += 1

    def stop(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.total += time.perf_counter() - self._since

    def read(self) -> float:
        return self.total + (time.perf_counter() - self._since if self.in_flight else 0.0)


class JudgeClient:
    """The judge's endpoint (module docstring). A context manager: ``with client:`` starts a local judge server
    at once and stops it after; otherwise it starts on the first request and stops at ``close()`` or exit."""

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.cache = JudgeCache(cfg.cache_entries, cfg.cache_dir)
        self.clock = BusyClock()
        self._group: Any = None
        """The launched judge server (a ``DeploymentGroup``), or None."""
        self._sampler: Optional[DeploymentSampler] = None
        self._start_lock = threading.Lock()
        self._semaphores: dict[int, asyncio.Semaphore] = {}
        self._counts: dict[str, float] = {}
        self._taken_at = time.perf_counter()
        self._busy_at_take = 0.0

    def __deepcopy__(self, memo: dict) -> "JudgeClient":
        return self  # a handle on a live endpoint: copies (``Config.to_dict``'s) share it

    # ---- lifecycle ----------------------------------------------------------------
    @property
    def base_url(self) -> Optional[str]:
        """The endpoint's URL (a launched server's once started)."""
        return self._sampler.base_url if self._sampler is not None else self.cfg.base_url

    def start(self) -> "JudgeClient":
        """Connect, or launch the local judge server and wait until it serves (idempotent, thread-safe)."""
        with self._start_lock:
            if self._sampler is not None:
                return self
            cfg = self.cfg
            if cfg.base_url is not None:
                self._sampler = DeploymentSampler(
                    cfg.base_url, api_key=cfg.api_key, model=cfg.model, timeout_s=cfg.timeout_s, max_retries=0
                )
                return self
            from training.deployment.group import DeploymentGroup
            from training.models import resolve_model

            logger.info("judge: launching an embedded server on %s", cfg.model)
            group = DeploymentGroup(resolve_model(cfg.model), cfg.deployment).start()
            self._group = group
            self._sampler = DeploymentSampler(
                group.base_urls, api_key=group.cfg.api_key, timeout_s=cfg.timeout_s, max_retries=0
            )
            logger.info("judge: serving at %s", self._sampler.base_url)
            return self

    def close(self) -> None:
        """Stop a launched judge server (idempotent; a later request starts it again)."""
        with self._start_lock:
            group, self._group, self._sampler = self._group, None, None
        if group is not None:
            group.stop()

    def __enter__(self) -> "JudgeClient":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- requests -----------------------------------------------------------------
    def _semaphore(self) -> asyncio.Semaphore:
        loop_id = id(asyncio.get_running_loop())
        if loop_id not in self._semaphores:
            self._semaphores = {loop_id: asyncio.Semaphore(self.cfg.max_concurrency)}
        return self._semaphores[loop_id]

    def _count(self, name: str, value: float = 1.0) -> None:
        self._counts[name] = self._counts.get(name, 0.0) + value

    def request_body(self, messages: list[dict], schema: Optional[dict]) -> dict:
        """The chat request of one judgement, without its seed (what the cache key hashes)."""
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": cfg.model,
            "messages": messages,
            "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens,
            "seed_base": cfg.seed,
        }
        if cfg.structured_output and schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "judgement", "schema": schema, "strict": True},
            }
        return body

    async def judge(self, messages: list[dict], schema: Optional[dict], parse: Callable[[str], T]) -> JudgeAnswer:
        """Ask the judge ``messages`` (answering ``schema``), read the answer with ``parse`` (which raises
        ``JudgeParseError`` on a bad answer); from the cache when the same request was answered before."""
        body = self.request_body(messages, schema)
        key = content_key(body)
        hit = self.cache.get(key)
        if hit is not None:
            self._count("judge/cache_hits")
            try:
                return JudgeAnswer(key, body, hit["raw"], parse(hit["raw"]), True, 0.0, 0)
            except (JudgeParseError, KeyError, TypeError):
                pass  # an entry from another parser (or a hand-edited file): ask again
        self._count("judge/cache_misses")
        if self._sampler is None:
            await asyncio.to_thread(self.start)
        t0 = time.perf_counter()
        raw, parsed, attempts = await self._ask(body, key, parse)
        seconds = time.perf_counter() - t0
        self._count("judge/seconds_total", seconds)
        self._count("judge/answered")
        self.cache.put(key, {"raw": raw})
        return JudgeAnswer(key, body, raw, parsed, False, seconds, attempts)

    async def _ask(self, body: dict, key: str, parse: Callable[[str], T]) -> tuple[str, T, int]:
        cfg = self.cfg
        wire = {k: v for k, v in body.items() if k != "seed_base"}
        if self.cfg.base_url is None:
            wire.pop("model")  # the launched server serves one model under its own name
        key_int = int(key[:15], 16)
        last = "no attempt"
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self._count("judge/retries")
                await asyncio.sleep(cfg.backoff_s * 2 ** (attempt - 1))
            wire["seed"] = derive_seed(cfg.seed, key_int, attempt)
            async with self._semaphore():
                self.clock.start()
                self._count("judge/requests")
                try:
                    assert self._sampler is not None
                    out = await asyncio.wait_for(
                        self._sampler.request("POST", "/v1/chat/completions", wire), cfg.timeout_s
                    )
                except asyncio.TimeoutError:
                    last = f"no answer within {cfg.timeout_s} s (judge.timeout_s)"
                    self._count("judge/timeouts")
                    continue
                except DeploymentRequestError as e:
                    if e.status is not None and e.status < 500 and e.status not in RETRY_STATUSES:
                        self._count("judge/failed_requests")
                        raise JudgeError(f"the judge refused the request: {e}") from e
                    last = str(e)
                    continue
                except (aiohttp.ClientError, OSError) as e:
                    last = f"connection failed: {e!r}"
                    continue
                finally:
                    self.clock.stop()
            try:
                raw = out["choices"][0]["message"]["content"] or ""
            except (KeyError, IndexError, TypeError):
                last = f"an answer without choices[0].message.content: {str(out)[:200]}"
                self._count("judge/parse_failures")
                continue
            try:
                return raw, parse(raw), attempt + 1
            except JudgeParseError as e:
                last = str(e)
                self._count("judge/parse_failures")
        self._count("judge/failed_requests")
        raise JudgeError(
            f"the judge at {self.base_url} gave no usable answer in {cfg.max_retries + 1} attempts: {last}"
        )

    # ---- metrics ------------------------------------------------------------------
    def take_metrics(self) -> dict[str, float]:
        """The ``judge/*`` counters since the last call, ``judge/busy_s`` and ``judge/time_share`` (module docstring)."""
        now, busy = time.perf_counter(), self.clock.read()
        wall = now - self._taken_at
        out = {
            name: self._counts.get(name, 0.0)
            for name in (
                "judge/requests",
                "judge/cache_hits",
                "judge/cache_misses",
                "judge/retries",
                "judge/timeouts",
                "judge/parse_failures",
                "judge/failed_requests",
            )
        }
        answered = self._counts.get("judge/answered", 0.0)
        if answered:
            out["judge/latency_s"] = self._counts.get("judge/seconds_total", 0.0) / answered
        out["judge/busy_s"] = busy - self._busy_at_take
        out["judge/time_share"] = min(1.0, out["judge/busy_s"] / wall) if wall > 0 else 0.0
        self._counts, self._taken_at, self._busy_at_take = {}, now, busy
        return out
