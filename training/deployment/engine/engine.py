"""The synchronous engine: ``step()`` = schedule → run → postprocess.

One step admits waiting requests (shares cached prefix blocks, prefills the new tokens as one
packed batch, samples their first token; followers of an identical prompt share its logits;
preempted sequences get their K/V back without sampling), gives every running sequence the KV block
its next token needs (preempting the youngest when the pool is full), runs one batched decode step
over them, then finishes sequences that hit a stop condition (their blocks are cached, parked or
freed at once) and registers the blocks that filled up. Not thread-safe:
:class:`~training.deployment.engine.async_engine.AsyncEngine` drives it from one thread and
hands requests in between steps.

Weight updates are applied between steps: ``wait_for_inflight`` stops admission until the
running set is empty (no sequence mixes two weight sets); otherwise at the next step boundary,
and running sequences go on under the new weights (in-flight update): they keep the K/V computed
so far (``inflight_update_kv="keep"``, as PipelineRL does) or have it recomputed first
(``"recompute"``). Every output token records the version that produced it. Either way no cached
or parked K/V of the old weights is reused afterwards. A streamed update that fails half-way
leaves ``weight_version = -1`` (the weights are a mix).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from training.utils.cache import local_model_path
from training.deployment.engine.requests import (
    EngineConfig,
    GenerationResult,
    PartialWeightUpdateError,
    SamplingParams,
    SequenceFailedError,
    validate_kv_fit,
    validate_request,
)
from training.deployment.engine.block_manager import BlockManager
from training.deployment.engine.constraints import GrammarMasks
from training.deployment.engine.runners.lean import PrefillItem
from training.deployment.engine.runners.build import build_runner
from training.deployment.engine.runners.sleep import RunnerSleep
from training.deployment.engine.token_sampler import SampleOutput, sample
from training.deployment.engine.scheduler import Admission, Scheduler
from training.deployment.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class PendingUpdate:
    """A validated weight set waiting for its moment; ``done(exc)`` is called once applied or failed.

    ``load``, when given, replaces ``runner.load_weights(tensors)``: it runs on the engine thread at
    the same moment (streamed updates that receive and copy one tensor at a time). A command of the
    engine thread's inbox (inbox.py): handed to ``LLMEngine.pending_updates``, which runs it when it may go
    (``apply_ready_updates``).
    """

    tensors: Mapping[str, torch.Tensor]
    weight_version: int
    wait_for_inflight: bool
    done: Callable[[Optional[BaseException]], None]
    load: Optional[Callable[[], None]] = None

    def run(self, engine: LLMEngine) -> None:
        """Engine thread, between two steps: copy the weights in, take their version and drop every cached or parked
        K/V of the old ones (running sequences keep theirs, or have it recomputed: ``inflight_update_kv``);
        ``done(None)``, or ``done(exc)`` with the old weights and version kept (a streamed update that failed half-way
        leaves version -1: the weights are a mix)."""
        try:
            if self.load is not None:
                engine.runner.begin_weight_write()
                try:
                    self.load()
                finally:  # streamed pieces went into runner.targets directly
                    engine.runner.weights_changed()
            else:
                engine.runner.load_weights(self.tensors)
        except BaseException as exc:  # validated before; a failure here is a bug, OOM or a lost peer
            log.exception("weight update failed while copying")
            if isinstance(exc, PartialWeightUpdateError):  # some tensors are new: no known version
                engine.weight_version = -1
                engine.scheduler.weights_changed()
            self.done(exc)
            return
        engine.weight_version = self.weight_version
        engine.scheduler.weights_changed()
        if engine.scheduler.running and engine.config.inflight_update_kv == "recompute":
            engine._recompute_running_kv()
        self.done(None)


def _eos_ids(path: str, hf_config, tokenizer) -> list[int]:
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        from transformers import GenerationConfig

        sources.insert(0, GenerationConfig.from_pretrained(path).eos_token_id)
    except Exception:  # no generation_config.json
        pass
    for s in sources:
        for i in s if isinstance(s, (list, tuple)) else [s]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


class LLMEngine:
    """Tokenizer + runner + scheduler; ``add_request`` then ``step()`` until sequences finish."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoConfig, AutoTokenizer

        if not config.model:
            raise ValueError("model: EngineConfig.model must name the folder or hub id to serve")
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.model_path = local_model_path(config.model)
        """``config.model``, or the cached snapshot folder of a hub id (so that it gets the lean forward)."""
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.runner, self.execution_path = build_runner(
            config, self.hf_config, self.model_path, self.device, self.dtype
        )
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = _eos_ids(self.model_path, self.hf_config, self.tokenizer)
        cache = self.runner.cache
        self.scheduler = Scheduler(
            BlockManager(cache.num_blocks, cache.block_size, cache.hand_out),
            config.max_batch_size,
            config.max_prefill_tokens,
            self.runner.copy_block,
            config.enable_prefix_caching,
        )
        self.grammars = GrammarMasks(self.tokenizer, self.vocab_size)
        """Token masks of constrained requests (``SamplingParams.constraint``); unused by other rows."""
        self.memory = RunnerSleep(self.runner)
        """Sleep and wake of the runner's memory (runners/sleep.py): what a ``SleepOrWake`` command changes."""
        self.weight_version = 0
        self._rng = random.Random(0 if config.seed is None else config.seed)
        self.pending_updates: list[PendingUpdate] = []
        self.counters = {
            "tokens_generated": 0,
            "steps": 0,
            "prefill_tokens": 0,
            "cached_prompt_tokens": 0,
            "max_running": 0,
            "requests_finished": 0,
            "requests_failed": 0,
            "requests_aborted": 0,
            "recomputed_tokens": 0,
            "preempted_recomputed_tokens": 0,
            "prompt_logprobs_requests": 0,
            "prompt_logprobs_tokens": 0,
        }

    # ----------------------------------------------------------------- requests
    def make_sequence(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        session_id: Optional[str] = None,
        on_finish: Optional[Callable[[GenerationResult], None]] = None,
    ) -> Sequence:
        """Validate a request (EngineError names the field; also one that alone could never fit the KV pool) and
        build its Sequence (not yet queued)."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.config.max_model_len)
        cache = self.runner.cache
        validate_kv_fit(
            len(prompt_token_ids), params.max_tokens, self.config.max_model_len, cache.block_size, cache.num_blocks
        )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        return Sequence(prompt_token_ids, params, gen, frozenset(stop_ids), session_id, on_finish)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> bool:
        """Finish ``seq`` now with ``abort``; False (no-op) if it already finished."""
        if seq.finish_reason is not None:
            return False
        self.counters["requests_aborted"] += 1
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.pending_updates)

    # ----------------------------------------------------------------- step
    def step(self) -> None:
        """schedule → run → postprocess, once."""
        self.apply_ready_updates()
        admitted = self.scheduler.admit()
        if admitted:
            self._prefill(admitted)
        running, shared = self.scheduler.schedule_decode()
        if running:
            self.counters["max_running"] = max(self.counters["max_running"], len(running))
            logits = self.runner.decode(
                [s.block_table for s in running],
                [s.last_token for s in running],
                [len(s.token_ids) - 1 for s in running],
                shared,
            )
            self._sample_and_postprocess(running, logits)
        self.scheduler.after_step()
        self.counters["steps"] += 1

    def _prefill(self, adm: Admission) -> None:
        """Prefill the admitted prompts, give followers their leader's K/V and logits row, sample.

        A preempted sequence's prefill only recomputes its K/V: nothing is sampled for it (its last
        token is already sampled and decodes next)."""
        try:
            logits = self.runner.prefill([p.item for p in adm.prefill])
        except BaseException:
            self.scheduler.prefill_failed(adm)
            raise
        self.scheduler.prefilled(adm)
        rows = [i for i, p in enumerate(adm.prefill) if p.sample]
        seqs = [adm.prefill[i].seq for i in rows]
        leader_row = {id(adm.prefill[i].seq): i for i in rows}
        rows += [leader_row[id(leader)] for _, leader in adm.followers]
        seqs += [f for f, _ in adm.followers]
        self.counters["prefill_tokens"] += sum(len(p.item.token_ids) for p in adm.prefill if p.sample)
        self.counters["preempted_recomputed_tokens"] += sum(len(p.item.token_ids) for p in adm.prefill if not p.sample)
        self.counters["cached_prompt_tokens"] += sum(s.cached_prompt_tokens for s in seqs)
        if seqs:
            self._sample_and_postprocess(seqs, logits[rows] if rows != list(range(len(logits))) else logits)

    def _sample_and_postprocess(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        native = self.execution_path.sampler == "native"  # the plan's sampler kernel (build_runner)
        grammar_errors: list[Optional[str]] = [None] * len(seqs)
        if any(s.params.constraint is not None for s in seqs):  # masked before sampling: the logprob is the mask's
            logits, grammar_errors = self.grammars.apply(logits, seqs)
        try:
            out = sample(logits, seqs, native)
        except Exception:  # a bug tied to some row: sample each row alone so only that row fails
            log.exception("batched sampling failed; retrying row by row")
            out = SampleOutput([], [], [], [])
            for i, seq in enumerate(seqs):
                try:
                    one = sample(logits[i : i + 1], [seq])
                except Exception as exc:
                    one = SampleOutput([0], [0.0], [None], [f"sampling raised {type(exc).__name__}: {exc}"])
                for mine, theirs in zip(
                    (out.token_ids, out.logprobs, out.top_logprobs, out.failed),
                    (one.token_ids, one.logprobs, one.top_logprobs, one.failed),
                ):
                    mine += theirs
        self.counters["tokens_generated"] += len(seqs)
        for seq, tok, lp, top, failed, bad in zip(
            seqs, out.token_ids, out.logprobs, out.top_logprobs, out.failed, grammar_errors
        ):
            failed = bad or failed
            if failed is not None:
                self._fail(seq, SequenceFailedError(f"sequence {seq.seq_id} failed: {failed}"))
                continue
            try:
                seq.append(tok, lp, self.weight_version, top)
                reason = self._stop_reason(seq, tok)
                if reason is not None:
                    self._finish(seq, reason)
                elif seq.on_token is not None:
                    seq.on_token(tok, lp, top, self.weight_version)
            except Exception as exc:  # post-processing (decode, a callback) failed for this row only
                log.exception("post-processing of sequence %d failed", seq.seq_id)
                self._fail(seq, SequenceFailedError(f"sequence {seq.seq_id} failed: {type(exc).__name__}: {exc}"))

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """End ``seq`` alone with an error (its blocks are released, its caller gets ``exc``)."""
        if seq.status == SequenceStatus.FINISHED:
            return
        cb, seq.on_finish = seq.on_finish, None
        self.scheduler.finish(seq, "abort")
        self.counters["requests_failed"] += 1
        if cb is not None:
            cb(exc)

    def _stop_reason(self, seq: Sequence, token: int) -> Optional[str]:
        params = seq.params
        if seq.matcher is not None and seq.matcher.advance(token):  # the grammar is complete: nothing may follow
            return "stop"
        if seq.num_output_tokens >= params.min_tokens:  # before min_tokens no stop condition applies
            if token in seq.stop_ids:
                seq.stop_reason = token if token in params.stop_token_ids else None
                return "stop"
            if params.stop and self._tail_has_stop(seq):
                text = self._decode(seq.output_token_ids)
                found = [(i, s) for s in params.stop if (i := text.find(s)) >= 0]
                if found:
                    cut, matched = min(found, key=lambda f: f[0])
                    seq.text = text[: cut + len(matched)] if params.include_stop_str_in_output else text[:cut]
                    seq.matched_stop_string = True
                    seq.stop_reason = matched
                    return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.config.max_model_len:
            return "length"
        return None

    def _tail_has_stop(self, seq: Sequence) -> bool:
        """Whether a stop string occurs in the text of the last few output tokens.

        Checked after every token, so a new match ends in the newest token and spans at most
        ``4 × len(stop)`` tokens (a character may take up to 4 byte tokens): decoding that tail
        keeps the check O(len(stop)) per token instead of re-decoding the whole output.
        """
        window = 4 * max(len(s) for s in seq.params.stop) + 4
        tail = self._decode(seq.output_token_ids[-window:])
        return any(s in tail for s in seq.params.stop)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if not seq.matched_stop_string:
            out = seq.output_token_ids
            if reason == "stop" and out and out[-1] in seq.stop_ids:
                out = out[:-1]
            seq.text = self._decode(out)
        self.scheduler.finish(seq, reason)
        self.counters["requests_finished"] += 1
        if seq.on_finish is not None:
            seq.on_finish(seq.result(self.weight_version))

    # ----------------------------------------------------------------- weights
    def apply_ready_updates(self) -> None:
        """Apply the queued weight updates that may go now, in order: one with ``wait_for_inflight`` waits for the
        running set to empty (admission stops until then, and the updates behind it wait too); the others go at
        once, running sequences going on under the new weights. Each update's ``done`` gets None or its error.

        Every ``step`` starts with it; the engine thread calls it alone while no step runs (paused or asleep)."""
        while self.pending_updates:
            upd = self.pending_updates[0]
            if upd.wait_for_inflight and self.scheduler.running:
                self.scheduler.admitting = False
                return
            self.pending_updates.pop(0).run(self)
        self.scheduler.admitting = True

    def _recompute_running_kv(self) -> None:
        """Recompute the K/V of every running sequence under the live weights (prefill, logits unused).

        Blocks shared by several sequences (a group's prompt) are recomputed once: a sequence whose
        leading blocks an earlier one recomputed starts after them (in the same batch too: the prefill
        writes every item's K/V of a layer before any item attends in it)."""
        bs, budget = self.scheduler.block_size, self.config.max_prefill_tokens
        done: set[int] = set()
        items: list[tuple[Sequence, PrefillItem]] = []
        for seq in self.scheduler.running:
            skip = 0
            while skip < len(seq.block_table) and seq.block_table[skip] in done and (skip + 1) * bs <= seq.num_cached:
                skip += 1
            done.update(seq.block_table[: seq.num_cached // bs])
            if seq.num_cached > skip * bs:
                items.append((seq, PrefillItem(seq.block_table, seq.token_ids[skip * bs : seq.num_cached], skip * bs)))
        while items:
            batch = [items.pop(0)]
            while items and sum(len(it.token_ids) for _, it in batch) + len(items[0][1].token_ids) <= budget:
                batch.append(items.pop(0))
            self.runner.prefill([it for _, it in batch])
            self.counters["recomputed_tokens"] += sum(len(it.token_ids) for _, it in batch)
        for seq in self.scheduler.running:
            self.scheduler.mark_recomputed(seq)

    def stats(self) -> dict:
        s = self.scheduler
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "parked_sessions": len(s.blocks.parked),
            "preemptions": s.preemptions,
            "weight_version": self.weight_version,
            "pending_weight_updates": len(self.pending_updates),
            "execution_path": self.execution_path.name,
            "execution_path_reason": self.execution_path.reason,
            "execution_kernels": self.execution_path.kernels(),
            **self.counters,
            "kv_cache": self.kv_cache_stats(),
            "pools": self.pools(),
        }

    def kv_cache_stats(self) -> dict:
        """The block pool: ``blocks_used`` (held by running sequences; a shared block counts once),
        ``blocks_cached`` (reusable prefixes: cached or parked), ``blocks_free``, ``blocks_total``, the same in
        bytes, ``resident_bytes`` (on CPU: the blocks touched so far), ``block_size`` and how it was sized."""
        cache = self.runner.cache
        out: dict = {"block_size": cache.block_size, **self.scheduler.blocks.stats()}
        for name in ("used", "cached", "free", "total"):
            out[f"bytes_{name}"] = out[f"blocks_{name}"] * cache.bytes_per_block
        out["resident_bytes"] = cache.resident_bytes()
        out["sized_by"] = cache.sized_by
        return out

    def pools(self) -> dict[str, dict]:
        """Every table the engine keeps, as ``{"size": n, "bound": m}``: the running batch (``max_batch_size``),
        the waiting queue (``max_waiting``; preempted sequences may go past it: they were accepted),
        the parked sessions and the KV blocks holding K/V (used + cached), both bounded by the pool's blocks."""
        s = self.scheduler
        blocks = s.blocks.stats()
        return {
            "running": {"size": len(s.running), "bound": s.max_running},
            "waiting": {"size": len(s.waiting), "bound": self.config.max_waiting},
            "parked_sessions": {"size": len(s.blocks.parked), "bound": blocks["blocks_total"]},
            "kv_cache_blocks": {
                "size": blocks["blocks_used"] + blocks["blocks_cached"],
                "bound": blocks["blocks_total"],
            },
        }
