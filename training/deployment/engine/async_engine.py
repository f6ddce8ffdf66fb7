"""``AsyncEngine``: the asyncio face of the engine; a background thread runs the steps.

Threading contract: only the engine thread touches the model, the scheduler and the KV cache.
Coroutines hand it commands (new requests, aborts, weight updates, prompt scoring, sleep / wake)
through one inbox guarded by one condition variable (``inbox.py``: its table says what the thread
takes when, and in which order); results come back to asyncio futures with
``loop.call_soon_threadsafe``. The thread sleeps while there is nothing to do or the engine is paused.

Prompt logprobs (``prompt_logprobs``) run on the same thread, between two steps, as a scoring
forward that never touches the KV cache (``runners/scoring.py``); like new requests they wait while the
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
    EngineDeadError,
    MAX_TOP_LOGPROBS,
    EngineConfig,
    EngineError,
    GenerationDelta,
    GenerationResult,
    SamplingParams,
    WeightUpdateError,
)
from training.deployment.engine.engine import LLMEngine, PendingUpdate
from training.deployment.engine.inbox import AbortRequest, AddRequest, Inbox
from training.deployment.engine.runners.scoring import PromptLogprobs, ScorePrompts
from training.deployment.engine.runners.sleep import SLEEP_LEVELS, SleepOrWake, trim_heap
from training.deployment.server.process_stats import rss_bytes
from training.deployment.engine.weights import load_safetensors, validate_update
from training.utils.openmp import release_openmp_threads, releasing_openmp_threads

log = logging.getLogger(__name__)

IDLE_TRIM_BYTES = 64 * 2**20
"""On CPU, when the engine runs out of work with its resident memory grown by more than this since it last
trimmed, the engine thread hands glibc's free heap pages back to the system (``malloc_trim``) before it sleeps:
a burst's activations (an eval's prefill of every prompt) would otherwise stay resident until the next burst,
and add to the next weight push's peak."""


class AsyncEngine:
    """Continuous-batching generation engine with prefix caching and in-flight weight updates."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine = LLMEngine(config)
        release_openmp_threads()  # the engine thread computes: no second OpenMP pool (training/utils/openmp.py)
        self._cond = threading.Condition()
        self._inbox = Inbox()
        """Commands for the engine thread (``inbox.py``), guarded by ``_cond``."""
        self._paused = False
        self._stopping = False
        self._in_step = False
        self.dead_reason: Optional[str] = None
        """Why the engine thread stopped on an error (None while it runs or after a clean shutdown): from then on
        every request fails with :class:`EngineDeadError` naming it, and the server's ``/health`` answers 503."""
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
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
        return self._inbox.requests() + len(self.engine.scheduler.waiting)

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
            s["waiting"] += self._inbox.requests()
            s["pools"]["waiting"]["size"] += self._inbox.requests()
            s["paused"] = self._paused
            s["num_threads"] = self._num_threads
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
            self._fail_queued(None)

    def _fail_queued(self, error: Optional[EngineDeadError]) -> None:
        """End everything handed in and not done (call with ``_cond`` held): on shutdown (``error`` None) requests
        end with ``finish_reason='abort'`` and other commands with a RuntimeError; after the engine thread died,
        every one fails with ``error``."""
        queued = self._inbox.drain()  # aborts among them are moot: every sequence is ended here
        held = [c.seq for c in queued if isinstance(c, AddRequest)]
        sched = self.engine.scheduler
        if error is None:
            for seq in held + list(sched.waiting) + list(sched.running):
                self.engine.abort(seq)
        else:
            for seq in held:  # never reached the scheduler: only its caller waits
                callback, seq.on_finish = seq.on_finish, None
                if callback is not None:
                    callback(error)
            self._fail_all(error)
        unfinished = (
            (PendingUpdate, "the weight update was applied"),
            (SleepOrWake, "the sleep / wake was applied"),
            (ScorePrompts, "the prompt logprobs were computed"),
        )
        for command in queued + self.engine.pending_updates:
            for kind, what in unfinished:
                if isinstance(command, kind):
                    command.done(error or RuntimeError(f"engine shut down before {what}"))
        self.engine.pending_updates.clear()

    def _run(self) -> None:
        """The engine thread: any error that escapes the step loop (at start, or between steps) ends the engine
        for good, recorded in ``dead_reason``; everything waiting fails with it at once (no request hangs)."""
        try:
            self._run_steps()
        except BaseException as exc:
            log.exception("the engine thread died")
            reason = f"{type(exc).__name__}: {exc}"
            with self._cond:
                self.dead_reason = reason
                self._stopping = True
                self._fail_queued(EngineDeadError(reason))
                self._cond.notify_all()

    def _run_steps(self) -> None:
        torch.set_num_threads(self._num_threads)
        if self.engine.device.type == "cuda":  # graphs capture on the thread's current device: make it ours
            torch.cuda.set_device(self.engine.device)
        on_cpu = self.engine.device.type == "cpu"
        trimmed_rss = rss_bytes() or 0
        while True:
            with self._cond:
                while not self._stopping and not self._inbox.ready(self.engine, self._paused):
                    if on_cpu and (rss_bytes() or 0) > trimmed_rss + IDLE_TRIM_BYTES:  # idle: a few ms, once a burst
                        trim_heap()
                        trimmed_rss = rss_bytes() or 0
                    self._cond.wait()
                if self._stopping:
                    return
                work = self._inbox.take(self.engine, self._paused)
                work.run_at_once(self.engine)
                self._in_step = True
            try:
                work.run(self.engine)
            except BaseException as exc:  # fail every in-flight request rather than hang them
                log.exception("engine step failed")
                self._fail_all(exc)
            finally:
                with self._cond:
                    self._in_step = False
                    self._cond.notify_all()

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
        """0 awake; 1 the KV cache is freed; 2 the weights too (runners/sleep.py)."""
        return self.engine.memory.level

    @property
    def sleep_counts(self) -> dict[str, int]:
        """``sleeps``, ``wakes`` and ``weight_reloads`` (a wake after level 2 with no push since) so far."""
        return self.engine.memory.counts

    async def sleep(self, level: int = 1) -> dict:
        """Finish what runs and waits, then free the KV cache (level 1) or the weights too (level 2).

        Requests that arrive while asleep wait and run after :meth:`wake_up`. A weight update while
        asleep lands (after level 2 the weights are allocated again and the engine sleeps on at level 1).
        Returns the bytes freed (``kv_cache_bytes``, ``derived_bytes``, ``weight_bytes``)."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level must be one of {SLEEP_LEVELS}, got {level!r}")
        fut = asyncio.get_running_loop().create_future()
        self._submit(SleepOrWake(level, self._deliver(fut)))
        return await fut

    async def wake_up(self) -> dict:
        """Re-allocate the KV cache and derived copies (after level 2 with no push since: reload the model
        folder's weights, version 0); held requests then run. ``{"reloaded_weights": bool}``."""
        fut = asyncio.get_running_loop().create_future()
        self._submit(SleepOrWake(0, self._deliver(fut)))
        return await fut

    # ----------------------------------------------------------------- the inbox
    def _post(self, command) -> None:
        """Hand ``command`` to the engine thread (call with ``_cond`` held, or it is taken here); raises
        :class:`EngineDeadError` once the engine thread has died."""
        with self._cond:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            self._inbox.post(command)
            self._cond.notify_all()

    def _submit(self, command) -> None:
        """``_post`` for a command that only a running engine thread may take (RuntimeError before ``start``)."""
        with self._cond:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if self._stopping or self._thread is None:
                raise RuntimeError("engine is not running: call start() first")
            self._post(command)

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
            self._post(AddRequest(seq))
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
            self._post(AddRequest(seq))
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

    async def prompt_logprobs(
        self, prompts: list[list[int]], top_k: int = 0, temperature: float = 1.0
    ) -> list[PromptLogprobs]:
        """Teacher-forced logprobs of every token of each prompt (``scoring.py``): a scoring forward on the engine
        thread between two steps that never reads or writes the KV cache. ``top_k``: the likeliest alternatives per
        position (0..20). ``temperature`` (> 0): the logprobs of softmax(logits / temperature), 1 = raw.
        Raises ``EngineError`` naming the field for an empty prompt, a token outside the
        vocabulary or a prompt longer than ``max_model_len``."""
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_LOGPROBS:
            raise EngineError(f"prompt_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_k!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise EngineError(f"temperature: prompt logprobs need a temperature > 0, got {temperature!r}")
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
        job = ScorePrompts([list(p) for p in prompts], top_k, self._deliver(fut), float(temperature))
        self._submit(job)
        try:
            return await fut
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    def abort(self, seq) -> None:
        """Ask the engine thread to abort ``seq`` at the next step boundary (no-op once finished)."""
        self._post(AbortRequest(seq))

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
        self._submit(PendingUpdate(tensors, int(weight_version), wait_for_inflight, self._deliver(fut), load))
        await fut

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
