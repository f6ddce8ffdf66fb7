"""Sleep and wake of a runner's memory (colocation on one GPU: the engine gives its memory to the trainer).

| level | freed | kept |
| --- | --- | --- |
| 1 | the KV cache's block pool; the derived weight copies (the native step's packed panels, oneDNN's reordered weights, CUDA graphs, logits buffers) | the weights (in fp32 on CPU with the native step: its packed panels, the only copy of the matmul weights between updates) |
| 2 | the same, and the weights | nothing but small tables (norm scales, RoPE, biases of the native step) |

Freeing resizes each tensor's storage to 0 bytes: the tensor objects, their views (``runner.targets``,
``cache.k[i]``) and their shapes stay, so whoever holds them needs no new reference; waking resizes the
storage back (new addresses: the native step's pointer table is rebuilt, CUDA graphs are re-captured on
first use). A storage that cannot be resized (the transformers fallback's parameters, memory-mapped from
the checkpoint) has its tensor's ``.data`` swapped for an empty one instead, and back at wake. The contents do
not survive: the block pool is new memory after a wake (``SleepOrWake`` drops every cached prefix and resets
the block manager; a block is zeroed when it is handed out, so the pool is not written whole), and level-2
weights must be loaded again (``restore_weights`` then a weight update, or at a wake with no update since the
model folder's weights, ``SleepOrWake``). Freed memory goes back to the system: ``torch.cuda.empty_cache``
on CUDA; on CPU ``gc.collect`` and glibc's ``malloc_trim(0)`` (where libc has it).

``SleepOrWake`` is the engine thread's command for one ``sleep`` / ``wake_up`` call (its inbox, inbox.py, says
when it runs): the runner's transition plus what the engine makes of it (no cached prefix survives a sleep, the
block manager starts afresh at a wake, a wake after level 2 with no push since reloads the model folder).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from training.deployment.engine.weights import load_safetensors

log = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)


def _unique_storages(tensors) -> list[torch.Tensor]:
    """One tensor per distinct storage (views of one fused tensor, tied weights: counted once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.is_mkldnn:
            continue
        s = t.untyped_storage()
        seen.setdefault(s.data_ptr() or id(s), t)
    return list(seen.values())


def release_host_memory(device: torch.device) -> None:
    """Return freed memory to the system: the CUDA caching allocator's blocks, or glibc's free heap pages."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    trim_heap()


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: the free pages its heap keeps go back to the system (a no-op on another libc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:  # not glibc: the allocator keeps what it keeps
        pass


@dataclass
class FreedStorages:
    """Tensors whose storage was resized to 0, and the byte size each had (to restore it)."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    swapped: list[bool] = field(default_factory=list)
    """True where the storage could not be resized (a memory-mapped checkpoint's, as transformers loads
    it): the tensor's ``.data`` was swapped for an empty one instead (the tensor object stays the same)."""

    def free(self, tensors) -> int:
        """Free each distinct storage of ``tensors``; returns the bytes freed."""
        total = 0
        with torch.inference_mode():
            for t in _unique_storages(tensors):
                s = t.untyped_storage()
                n, shape = s.nbytes(), tuple(t.shape)
                if n == 0:
                    continue
                try:
                    s.resize_(0)
                    swapped = False
                except RuntimeError:  # not resizable: swap the data (only whole tensors: the fallback's parameters)
                    n = t.nbytes
                    t.data = t.new_empty(0)
                    swapped = True
                self.tensors.append(t)
                self.nbytes.append(n)
                self.swapped.append(swapped)
                self.shapes.append(shape)
                total += n
        return total

    def restore(self) -> int:
        """Give every freed storage its size back (contents undefined); returns the bytes allocated."""
        total = 0
        with torch.inference_mode():
            for t, n, swapped, shape in zip(self.tensors, self.nbytes, self.swapped, self.shapes):
                if swapped:
                    t.data = torch.empty(shape, dtype=t.dtype, device=t.device)
                else:
                    t.untyped_storage().resize_(n)
                total += n
        self.tensors, self.nbytes, self.swapped, self.shapes = [], [], [], []
        return total

    @property
    def total(self) -> int:
        return sum(self.nbytes)


class RunnerSleep:
    """Frees and restores one runner's memory (``LeanModelRunner`` or ``HFModelRunner``); engine thread only."""

    def __init__(self, runner):
        self.runner = runner
        self.level = 0
        """0 awake; 1 KV cache (and derived copies) freed; 2 the weights too."""
        self._kv = FreedStorages()
        self._derived = FreedStorages()
        self._weights = FreedStorages()
        self.counts = {"sleeps": 0, "wakes": 0, "weight_reloads": 0}
        """Sleeps and wakes so far, and wakes after level 2 that reloaded the model folder (``SleepOrWake``)."""

    # ---- what each level frees -----------------------------------------------------------
    def _kv_tensors(self) -> list[torch.Tensor]:
        cache = self.runner.cache
        return [cache.k_all, cache.v_all]

    def _weight_tensors(self) -> list[torch.Tensor]:
        tensors = list(self.runner.targets.values())
        if getattr(self.runner, "native_linears", False):  # the packed panels are the live matmul weights
            native = self.runner.native
            tensors += [*(p for ps in native.packed.values() for p in ps), native.lm_head]
        return tensors

    def _free_derived(self) -> int:
        """Drop the copies made from the weights (rebuilt by ``weights_changed`` at wake)."""
        r, freed = self.runner, 0
        for L in getattr(r, "layers", []):
            for name in [k for k in L if k.endswith("_packed")]:
                del L[name]  # oneDNN's opaque reordered weights: dropped, re-made at wake
        if getattr(r, "lm_head_packed", None) is not None:
            r.lm_head_packed = None
        release_logits = getattr(r, "release_logits_buffer", None)  # the lean runner's CPU logits buffer
        if release_logits is not None:
            freed += release_logits()
        native = getattr(r, "native", None)
        if native is not None and not getattr(r, "native_linears", False):  # else they are the weights: level 2
            freed += self._derived.free([*(p for ps in native.packed.values() for p in ps), native.lm_head])
            native.release_logits_buffer()
        graphs = getattr(r, "graphs", None)
        if graphs is not None:  # graphs hold the old addresses: captured again on first use
            graphs.graphs.clear()
            graphs.pool = None
        return freed

    # ---- transitions ---------------------------------------------------------------------
    def sleep(self, level: int) -> dict[str, int]:
        """Free what ``level`` frees (a deeper level on a sleeping runner frees the rest); the bytes freed."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level must be one of {SLEEP_LEVELS}, got {level!r}")
        freed = {"kv_cache_bytes": 0, "derived_bytes": 0, "weight_bytes": 0}
        if self.level == 0:
            resident = self.runner.cache.resident_bytes()  # on CPU the untouched rest of the pool was never resident
            freed["kv_cache_bytes"] = min(resident, self._kv.free(self._kv_tensors()))
            freed["derived_bytes"] = self._free_derived()
        if level == 2 and self.level < 2:
            freed["weight_bytes"] = self._weights.free(self._weight_tensors())
        self.level = max(self.level, level)
        self.runner.sleeping = True  # a weight update while asleep derives no copies (model_runner.weights_changed)
        release_host_memory(self.runner.device)
        return freed

    def restore_weights(self) -> None:
        """Level 2 → 1: allocate the weight storage again (contents undefined until a weight update fills it)."""
        if self.level == 2:
            self._weights.restore()
            self.level = 1

    def wake(self) -> None:
        """Allocate the KV cache and the derived copies again and rebuild them from the live weights.

        The weights must be valid (awake at level 1, or restored and loaded after level 2)."""
        if self.level == 0:
            return
        if self.level == 2:
            raise RuntimeError("wake: the weights are freed; restore_weights() and load them first")
        self._kv.restore()
        self.runner.cache.restored()
        self._derived.restore()
        self.runner.sleeping = False
        self.runner.weights_changed()  # re-pack the native panels, re-make oneDNN's copies
        native = getattr(self.runner, "native", None)
        if native is not None:  # the C side reads raw addresses: point it at the new storage
            native.repoint()
        self.level = 0


@dataclass
class SleepOrWake:
    """One ``sleep(level)`` (``level`` 1 / 2) or ``wake_up()`` (``level`` 0) for the engine thread; ``done(result or
    exc)``: the bytes freed (``RunnerSleep.sleep``), or ``{"reloaded_weights": bool}`` for a wake."""

    level: int
    done: Callable

    def run(self, engine) -> None:
        """Engine thread, nothing running: free (level 1 / 2) or re-allocate (0) the runner's memory (``engine``: the
        ``LLMEngine``, its ``memory``, scheduler and weight version)."""
        memory = engine.memory
        try:
            if self.level > 0:
                result = memory.sleep(self.level)
                engine.scheduler.weights_changed()  # the freed K/V is gone: no cached prefix survives
                memory.counts["sleeps"] += 1
            else:
                result = {"reloaded_weights": memory.level == 2}
                if memory.level == 2:  # no push since the sleep: the served model folder's weights
                    log.warning("wake_up after a level-2 sleep with no weight push: reloading %s", engine.model_path)
                    memory.restore_weights()
                    engine.runner.load_weights(load_safetensors(engine.model_path))
                    engine.weight_version = 0
                    memory.counts["weight_reloads"] += 1
                woke = memory.level > 0
                memory.wake()
                engine.scheduler.weights_changed()
                engine.scheduler.blocks.reset()  # fresh pool memory: hand out blocks from the first again
                memory.counts["wakes"] += woke
            self.done(result)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            log.exception("sleep / wake failed")
            self.done(exc)
