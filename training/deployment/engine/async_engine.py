"""``AsyncEngine``: the asyncio face of the engine; a background thread runs the steps.

Threading contract: only the engine thread touches the model, the scheduler and the KV cache.
Coroutines hand it requests, aborts and weight updates through an inbox guarded by one
condition variable; results come back to asyncio futures with ``loop.call_soon_threadsafe``.
The thread sleeps while there is nothing to do or the engine is paused.

Prompt logprobs (``prompt_logprobs``) run on the same thread, between two steps, as a scoring
forward that never touches the KV cache (``scoring.py``); like new requests they wait while the
engine is paused or asleep.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import AsyncIterator, Callable, Mapping, Optional

import torch

from training.deployment.engine.requests import (
    EngineBusyError,
    MAX_TOP_LOGPROBS,
    EngineConfig,
    EngineError,
    GenerationDelta,
    GenerationResult,
    SamplingParams,
    WeightUpdateError,
)
from training.deployment.engine.engine import LLMEngine, PendingUpdate
from training.deployment.engine.runners.scoring import PromptLogprobs, score_prompts
from training.deployment.engine.sequence import Sequence
from training.deployment.engine.runners.sleep import SLEEP_LEVELS, RunnerSleep, trim_heap
from training.deployment.server.process_stats import rss_bytes
from training.deployment.engine.weights import load_safetensors, validate_update
from training.utils.openmp import release_openmp_threads, releasing_openmp_threads

log = logging.getLogger(__name__)

IDLE_TRIM_BYTES = 64 * 2**20
"""On CPU, when the engine runs out of work with its resident memory grown by more than this since it last
trimmed, the engine thread hands glibc's free heap pages back to the system (``malloc_trim``) before it sleeps:
a burst's activations (an eval's prefill of every prompt) would otherwise stay resident until the next burst,
and add to the next weight push's peak."""


class _ScoreJob:
    """One ``prompt_logprobs`` call waiting for the engine thread (skipped if its caller went away first)."""

    def __init__(self, prompts: list[list[int]], top_k: int, done: Callable):
        self.prompts, self.top_k, self.done = prompts, top_k, done
        self.cancelled = False


class AsyncEngine:
    """Continuous-batching generation engine with prefix caching and in-flight weight updates."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine = LLMEngine(config)
        release_openmp_threads()  # the engine thread computes: no second OpenMP pool (training/utils/openmp.py)
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[Sequence] = []
        self._updates: list[PendingUpdate] = []
        self._scores: list[_ScoreJob] = []
        """``prompt_logprobs`` calls waiting for the engine thread (run between two steps)."""
        self.score_counts = {"prompt_logprobs_requests": 0, "prompt_logprobs_tokens": 0}
        self._paused = False
        self._stopping = False
        self._in_step = False
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._sleep = RunnerSleep(self.engine.runner)
        self._sleep_ops: list[tuple[int, Callable]] = []
        """Pending sleep (level 1 / 2) and wake (level 0) requests, applied in order by the engine thread."""
        self.sleep_counts = {"sleeps": 0, "wakes": 0, "weight_reloads": 0}
        self._num_threads = config.num_threads or torch.get_num_threads()
        """CPU threads of the engine thread's torch ops (OpenMP settings are per thread: handed on in ``_run``)."""

    # ----------------------------------------------------------------- properties
    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def model_name(self) -> str:
        p = Path(self.config.model)
        return p.name if p.exists() else self.config.model

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.engine.eos_token_ids)

    def queued(self) -> int:
        """Sequences waiting for admission: handed in and not yet seen by the engine thread, or in its queue."""
        return len(self._inbox) + len(self.engine.scheduler.waiting)

    def check_room(self, sequences: int = 1) -> None:
        """Raise :class:`EngineBusyError` unless ``sequences`` more may queue: the queue would pass
        ``max_waiting`` (a request is always accepted while nothing waits). The server asks before it
        starts a request (so a stream is refused with a 503 before its first byte); ``generate`` asks again."""
        waiting = self.queued()
        if waiting and waiting + sequences > self.config.max_waiting:
            raise EngineBusyError(
                f"the engine's waiting queue is full ({waiting} sequences queued, max_waiting="
                f"{self.config.max_waiting}; EngineConfig.max_waiting): retry shortly"
            )

    def stats(self) -> dict:
        with self._cond:
            s = self.engine.stats()
            s["waiting"] += len(self._inbox)
            s["pools"]["waiting"]["size"] += len(self._inbox)
            s["paused"] = self._paused
            s["num_threads"] = self._num_threads
            s.update(self.score_counts)
            return s

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the thread; every unfinished request gets ``finish_reason='abort'``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        with self._cond:
            seqs = self._inbox + list(self.engine.scheduler.waiting) + list(self.engine.scheduler.running)
            self._inbox.clear()
            for seq in seqs:
                self.engine.abort(seq)
            for upd in self._updates + self.engine.pending_updates:
                upd.done(RuntimeError("engine shut down before the weight update was applied"))
            self._updates.clear()
            self.engine.pending_updates.clear()
            for _, done in self._sleep_ops:
                done(RuntimeError("engine shut down before the sleep / wake was applied"))
            self._sleep_ops.clear()
            for job in self._scores:
                job.done(RuntimeError("engine shut down before the prompt logprobs were computed"))
            self._scores.clear()

    def _ready(self) -> bool:
        if self._sleep_ops and self._sleep_op_ready():
            return True
        if (self._inbox and not self._holding()) or self._aborts:
            return True
        if self._scores and not (self._holding() or self._paused):
            return True
        if self._sleep.level:  # asleep: only weight updates proceed (they land in the restored weights)
            return bool(self._updates or self.engine.pending_updates)
        if self._paused:  # only a weight update that needs no running step may proceed
            ups = self._updates + self.engine.pending_updates
            return bool(ups) and (not ups[0].wait_for_inflight or not self.engine.scheduler.running)
        return bool(self._updates) or self.engine.has_work()

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        if self.engine.device.type == "cuda":  # graphs capture on the thread's current device: make it ours
            torch.cuda.set_device(self.engine.device)
        on_cpu = self.engine.device.type == "cpu"
        trimmed_rss = rss_bytes() or 0
        while True:
            with self._cond:
                while not self._stopping and not self._ready():
                    if on_cpu and (rss_bytes() or 0) > trimmed_rss + IDLE_TRIM_BYTES:  # idle: a few ms, once a burst
                        trim_heap()
                        trimmed_rss = rss_bytes() or 0
                    self._cond.wait()
                if self._stopping:
                    return
                if not self._holding():
                    for seq in self._inbox:
                        self.engine.add(seq)
                    self._inbox.clear()
                scores: list[_ScoreJob] = []
                if not (self._holding() or self._paused):
                    scores, self._scores = self._scores, []
                sleep_op = self._sleep_ops.pop(0) if self._sleep_ops and self._sleep_op_ready() else None
                for seq in self._aborts:
                    self.engine.abort(seq)
                self._aborts.clear()
                self.engine.pending_updates.extend(self._updates)
                self._updates.clear()
                paused = self._paused or self._sleep.level > 0
                self._in_step = True
            try:
                self._run_scores(scores)  # taken only when neither paused nor asleep
                if sleep_op is not None:
                    self._apply_sleep_op(*sleep_op)
                elif paused:
                    if self._sleep.level == 2 and self.engine.pending_updates:
                        self._sleep.restore_weights()  # a push to a level-2 sleeper lands; KV stays freed
                    self.engine.apply_ready_updates()
                elif self.engine.has_work() or not scores:
                    self.engine.step()
            except BaseException as exc:  # fail every in-flight request rather than hang them
                log.exception("engine step failed")
                self._fail_all(exc)
            finally:
                with self._cond:
                    self._in_step = False
                    self._cond.notify_all()

    def _run_scores(self, jobs: list[_ScoreJob]) -> None:
        """Engine thread: each waiting ``prompt_logprobs`` call, between two steps; a failure is its caller's alone."""
        for job in jobs:
            if job.cancelled:
                continue
            try:
                scored = score_prompts(self.engine.runner, job.prompts, job.top_k)
                for s in scored:
                    s.weight_version = self.engine.weight_version
                self.score_counts["prompt_logprobs_requests"] += 1
                self.score_counts["prompt_logprobs_tokens"] += sum(len(p) for p in job.prompts)
                job.done(scored)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                log.exception("prompt logprobs failed")
                job.done(exc)

    def _fail_all(self, exc: BaseException) -> None:
        sched = self.engine.scheduler
        for seq in list(sched.running) + list(sched.waiting):
            cb, seq.on_finish = seq.on_finish, None
            sched.finish(seq, "abort")
            if cb is not None:
                cb(exc)

    # ----------------------------------------------------------------- sleep / wake
    @property
    def sleep_level(self) -> int:
        """0 awake; 1 the KV cache is freed; 2 the weights too (sleep.py)."""
        return self._sleep.level

    def _holding(self) -> bool:
        """New requests stay in the inbox: the engine sleeps or is about to (they run after the wake)."""
        return self._sleep.level > 0 or any(level > 0 for level, _ in self._sleep_ops)

    def _sleep_op_ready(self) -> bool:
        """A sleep waits until nothing runs or waits and no update is pending; a wake goes at once."""
        level, _ = self._sleep_ops[0]
        if level == 0:
            return True
        return not self.engine.has_work() and not self._updates

    def _apply_sleep_op(self, level: int, done: Callable) -> None:
        """Engine thread: free (level 1 / 2) or re-allocate (0) the runner's memory; ``done(result or exc)``."""
        try:
            if level > 0:
                result = self._sleep.sleep(level)
                self.engine.scheduler.weights_changed()  # the freed K/V is gone: no cached prefix survives
                self.sleep_counts["sleeps"] += 1
            else:
                result = {"reloaded_weights": self._sleep.level == 2}
                if self._sleep.level == 2:  # no push since the sleep: the served model folder's weights
                    log.warning(
                        "wake_up after a level-2 sleep with no weight push: reloading %s", self.engine.model_path
                    )
                    self._sleep.restore_weights()
                    self.engine.runner.load_weights(load_safetensors(self.engine.model_path))
                    self.engine.weight_version = 0
                    self.sleep_counts["weight_reloads"] += 1
                woke = self._sleep.level > 0
                self._sleep.wake()
                self.engine.scheduler.weights_changed()
                self.engine.scheduler.blocks.reset()  # fresh pool memory: hand out blocks from the first again
                self.sleep_counts["wakes"] += woke
            done(result)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            log.exception("sleep / wake failed")
            done(exc)

    async def sleep(self, level: int = 1) -> dict:
        """Finish what runs and waits, then free the KV cache (level 1) or the weights too (level 2).

        Requests that arrive while asleep wait and run after :meth:`wake_up`. A weight update while
        asleep lands (after level 2 the weights are allocated again and the engine sleeps on at level 1).
        Returns the bytes freed (``kv_cache_bytes``, ``derived_bytes``, ``weight_bytes``)."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level must be one of {SLEEP_LEVELS}, got {level!r}")
        return await self._queue_sleep_op(level)

    async def wake_up(self) -> dict:
        """Re-allocate the KV cache and derived copies (after level 2 with no push since: reload the model
        folder's weights, version 0); held requests then run. ``{"reloaded_weights": bool}``."""
        return await self._queue_sleep_op(0)

    async def _queue_sleep_op(self, level: int) -> dict:
        fut = asyncio.get_running_loop().create_future()
        with self._cond:
            if self._stopping or self._thread is None:
                raise RuntimeError("engine is not running: call start() first")
            self._sleep_ops.append((level, self._deliver(fut)))
            self._cond.notify_all()
        return await fut

    # ----------------------------------------------------------------- requests
    def _deliver(self, fut: asyncio.Future):
        loop = self._loop or asyncio.get_running_loop()

        def done(value) -> None:
            def set_value():
                if fut.done():
                    return
                if isinstance(value, BaseException):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)

            loop.call_soon_threadsafe(set_value)

        return done

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, session_id: Optional[str] = None
    ) -> GenerationResult:
        """Generate for one prompt; raises EngineError (naming the field) for a bad request, EngineBusyError when
        the waiting queue is full (``max_waiting``)."""
        fut = asyncio.get_running_loop().create_future()
        with self._cond:
            seq = self.engine.make_sequence(list(prompt_token_ids), params, session_id, self._deliver(fut))
            self.check_room()
            self._inbox.append(seq)
            self._cond.notify_all()
        try:
            return await fut
        except asyncio.CancelledError:
            self.abort(seq)
            raise

    async def generate_stream(
        self, prompt_token_ids: list[int], params: SamplingParams, session_id: Optional[str] = None
    ) -> AsyncIterator[GenerationDelta]:
        """Generate for one prompt, yielding the new tokens as the steps produce them.

        Every delta carries the tokens that arrived since the previous one; the last carries the
        finished ``result`` too. Raises EngineError before the first delta for a bad request (EngineBusyError when the
        waiting queue is full), and
        ``SequenceFailedError`` if the engine fails this sequence. Closing the iterator early
        (``aclose``, a cancelled consumer) aborts the sequence at the next step boundary.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, item)

        with self._cond:
            seq = self.engine.make_sequence(list(prompt_token_ids), params, session_id, put)
            self.check_room()
            seq.on_token = lambda tok, lp, top, version: put((tok, lp, top, version))
            self._inbox.append(seq)
            self._cond.notify_all()
        received, finished = 0, False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                delta = GenerationDelta([], [], [] if params.top_logprobs else None)
                for item in items:
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    if isinstance(item, GenerationResult):  # the last tokens come with the result
                        finished = True
                        delta.result = item
                        delta.token_ids += item.output_token_ids[received:]
                        delta.logprobs += item.output_logprobs[received:]
                        if delta.top_logprobs is not None:
                            delta.top_logprobs += (item.output_top_logprobs or [])[received:]
                        delta.weight_versions += _token_versions(item)[received:]
                        break
                    tok, lp, top, version = item
                    received += 1
                    delta.token_ids.append(tok)
                    delta.logprobs.append(lp)
                    delta.weight_versions.append(version)
                    if delta.top_logprobs is not None:
                        delta.top_logprobs.append(top)
                yield delta
        finally:
            if not finished:
                self.abort(seq)

    async def prompt_logprobs(self, prompts: list[list[int]], top_k: int = 0) -> list[PromptLogprobs]:
        """Teacher-forced logprobs of every token of each prompt (``scoring.py``): a scoring forward on the engine
        thread between two steps that never reads or writes the KV cache. ``top_k``: the likeliest alternatives per
        position (0..20). Raises ``EngineError`` naming the field for an empty prompt, a token outside the
        vocabulary or a prompt longer than ``max_model_len``."""
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_LOGPROBS:
            raise EngineError(f"prompt_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_k!r}")
        vocab, limit = self.vocab_size, self.max_model_len
        for p in prompts:
            if not p:
                raise EngineError("prompt_token_ids: must not be empty")
            if len(p) > limit:
                raise EngineError(f"prompt_token_ids: {len(p)} tokens exceed max_model_len ({limit})")
            for i, t in enumerate(p):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise EngineError(f"prompt_token_ids[{i}]: {t!r} is not a token id in [0, {vocab})")
        fut = asyncio.get_running_loop().create_future()
        job = _ScoreJob([list(p) for p in prompts], top_k, self._deliver(fut))
        with self._cond:
            if self._stopping or self._thread is None:
                raise RuntimeError("engine is not running: call start() first")
            self._scores.append(job)
            self._cond.notify_all()
        try:
            return await fut
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    def abort(self, seq) -> None:
        """Ask the engine thread to abort ``seq`` at the next step boundary (no-op once finished)."""
        with self._cond:
            self._aborts.append(seq)
            self._cond.notify_all()

    # ----------------------------------------------------------------- weights
    async def update_weights(
        self, tensors: Mapping[str, torch.Tensor], weight_version: int, *, wait_for_inflight: bool = True
    ) -> None:
        """Validate a full weight set (WeightUpdateError names the problem), then swap it in.

        ``wait_for_inflight``: stop admitting, let running sequences finish on the old weights,
        swap, resume. False: swap between two decode steps; running sequences go on under the new
        weights (their K/V kept or recomputed: ``EngineConfig.inflight_update_kv``) and each token
        records its version. Cached and parked K/V of the old weights is dropped.
        """
        runner = self.engine.runner
        checked = await asyncio.to_thread(
            releasing_openmp_threads(validate_update), tensors, runner.weight_shapes, runner.tied
        )
        await self._queue_update(checked, weight_version, wait_for_inflight, None)

    async def update_weights_streamed(
        self, load: Callable[[], None], weight_version: int, *, wait_for_inflight: bool = True
    ) -> None:
        """Run ``load()`` on the engine thread when a full update would be swapped in (same pause rules).

        ``load`` copies an already validated full set into ``runner.targets`` piece by piece (the
        torch.distributed path receives one tensor at a time). If it raises
        ``PartialWeightUpdateError`` the engine's version becomes -1 (the weights are a mix).
        """
        await self._queue_update({}, weight_version, wait_for_inflight, load)

    async def _queue_update(
        self,
        tensors: Mapping[str, torch.Tensor],
        weight_version: int,
        wait_for_inflight: bool,
        load: Optional[Callable[[], None]],
    ) -> None:
        fut = asyncio.get_running_loop().create_future()
        with self._cond:
            if self._stopping or self._thread is None:
                raise RuntimeError("engine is not running: call start() first")
            self._updates.append(
                PendingUpdate(tensors, int(weight_version), wait_for_inflight, self._deliver_update(fut), load)
            )
            self._cond.notify_all()
        await fut

    def _deliver_update(self, fut: asyncio.Future):
        deliver = self._deliver(fut)
        return lambda exc: deliver(exc if exc is not None else None)

    async def update_weights_from_disk(self, path: str, weight_version: int, **kw) -> None:
        """Map a safetensors folder (or file) (``load_safetensors``: views on the files, nothing copied), then
        :meth:`update_weights`."""
        try:
            tensors = await asyncio.to_thread(releasing_openmp_threads(load_safetensors), path)
        except FileNotFoundError as exc:
            raise WeightUpdateError(f"path: {exc}") from exc
        await self.update_weights(tensors, weight_version, **kw)

    # ----------------------------------------------------------------- pause
    async def pause(self) -> None:
        """No new prefill or decode step runs until :meth:`resume`; returns once the current step ended."""
        with self._cond:
            self._paused = True
        await asyncio.to_thread(self._wait_idle)

    def _wait_idle(self) -> None:
        with self._cond:
            while self._in_step:
                self._cond.wait()

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()


def _token_versions(result: GenerationResult) -> list[int]:
    """Per output token, the weight version that sampled it (the result's own list when the engine keeps one;
    else the version the result was finished under, which sampled its last tokens)."""
    versions = getattr(result, "token_weight_versions", None)
    return list(versions) if versions else [result.weight_version] * len(result.output_token_ids)
