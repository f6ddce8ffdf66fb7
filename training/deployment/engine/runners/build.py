"""The one place that chooses how the engine runs its forward: ``build_runner``.

| path | runs when | why it exists |
| --- | --- | --- |
| ``native`` | lean forward, CPU, fp32 or bf16, ``decode_kernel`` ``auto`` or ``native``, native_decode.c builds (one library per dtype) | the fastest CPU decode step: one call into C per step (engine/README.md, "The native decode step") |
| ``torch`` | lean forward, and ``decode_kernel="torch"``, or fp16, or no working C compiler (``auto``), or CUDA without graph batch sizes | the lean forward's decode step in torch ops: any device and dtype |
| ``cuda_graphs`` | lean forward on CUDA with ``cuda_graph_batch_sizes`` | the torch step replayed from CUDA graphs (cuda_graphs.py): no launch overhead per op |
| ``hf_fallback`` | ``use_lean_forward=False``, or the model is not a local safetensors folder (a hub id not in the local cache), or its architecture is not Llama / Qwen2 / Qwen3 | transformers' forward over the same block pool (runners/hf.py): any causal LM it can load, slower |

A hub id (``Qwen/Qwen3-0.6B``) is resolved to its cached snapshot folder by the engine first
(``training.utils.cache.local_model_path``), so a cached model takes the lean path.

The plan also names the kernels around the decode step, chosen here with the path:

| kernel | choice | when |
| --- | --- | --- |
| ``matmul`` (the prefill's, scoring's and the torch step's matmuls, the LM head) | ``native`` / ``onednn`` / ``torch`` | ``native``: the fp32 native step (C on its packed panels, no other weight copy); ``onednn``: another lean path on CPU in fp32, or bf16 where the CPU has it (lean.py: ``matmul_kernel``); ``torch``: the rest (CUDA, fp16, transformers) |
| ``sampler`` (a batch of plain rows: temperature alone) | ``native`` / ``torch`` | ``native`` with the native step (``native.sample_plain``); ``torch`` otherwise (token_sampler.py) |

The choice is logged once at start (``engine path: ...``, the kernels included) and reported by ``GET /stats``
(``execution_path``, ``execution_path_reason``, ``execution_kernels``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from training.deployment.engine.kv_cache import KVBudget
from training.deployment.engine.runners.lean import LeanModelRunner, lean_supported, matmul_kernel
from training.deployment.engine.runners.native import NativeUnavailable, native_available
from training.utils.config import EngineConfig

log = logging.getLogger(__name__)

EXECUTION_PATHS = ("native", "torch", "cuda_graphs", "hf_fallback")

_DESCRIPTIONS = {
    "native": "native C decode step",
    "torch": "lean forward, torch decode step",
    "cuda_graphs": "lean forward, CUDA-graph decode step",
    "hf_fallback": "transformers forward fallback",
}


@dataclass(frozen=True)
class ExecutionPath:
    """The engine's execution plan: which path it runs (one of ``EXECUTION_PATHS``), why, and its kernels."""

    name: str
    reason: str
    matmul: str = "torch"
    """The matmuls outside the C decode step and the LM head: ``native``, ``onednn`` or ``torch``
    (``MATMUL_KERNELS``, lean.py; the module docstring's second table)."""
    sampler: str = "torch"
    """The draw of a batch of plain rows: ``native`` (C, with the native step) or ``torch``."""

    def describe(self) -> str:
        return f"{_DESCRIPTIONS[self.name]} ({self.reason}); matmuls {self.matmul}, sampler {self.sampler}"

    def kernels(self) -> dict[str, str]:
        """``{"matmul": ..., "sampler": ...}`` (``GET /stats``: ``execution_kernels``)."""
        return {"matmul": self.matmul, "sampler": self.sampler}


def _fallback_reason(config: EngineConfig, hf_config, model_path: str) -> str | None:
    """Why the lean forward cannot run this model, or None."""
    if not config.use_lean_forward:
        return "use_lean_forward=False"
    if not (Path(model_path).is_dir() and any(Path(model_path).glob("*.safetensors"))):
        return f"{model_path!r} is not a local safetensors folder (nor a hub id in the local cache)"
    return lean_supported(hf_config)


def _native_reason(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the native decode step is chosen, else why not; ``decode_kernel="native"`` raises instead."""
    if config.decode_kernel == "torch":
        return "decode_kernel='torch'"
    reason = native_available(device, dtype)
    if reason is not None and config.decode_kernel == "native":
        raise ValueError(f"decode_kernel='native' cannot run here: {reason}")
    return reason


def build_runner(config: EngineConfig, hf_config, model_path: str, device: torch.device, dtype: torch.dtype):
    """The engine's runner (``LeanModelRunner`` or ``HFModelRunner``) and the ``ExecutionPath`` it takes.

    ``model_path``: the folder to load (a hub id already resolved by ``local_model_path``).
    Raises ValueError when ``decode_kernel="native"`` cannot run here (naming the reason).
    """
    budget = KVBudget.from_config(config)
    fallback = _fallback_reason(config, hf_config, model_path)
    if fallback is not None:
        from training.deployment.engine.runners.hf import HFModelRunner

        path = ExecutionPath("hf_fallback", fallback)  # transformers' own matmuls, torch's sampler
        runner = HFModelRunner(model_path, dtype, device, budget, config.max_model_len)
    else:
        not_native = _native_reason(config, device, dtype)
        args = (model_path, hf_config, budget, config.max_model_len, dtype, device)
        matmul = matmul_kernel(not_native is None, device, dtype)
        try:
            runner = LeanModelRunner(*args, native=not_native is None, matmul=matmul)
        except NativeUnavailable as exc:  # the library built, but this model's shape is not one it runs
            if config.decode_kernel == "native":
                raise ValueError(f"decode_kernel='native' cannot run here: {exc}") from exc
            not_native, matmul = str(exc), matmul_kernel(False, device, dtype)
            runner = LeanModelRunner(*args, native=False, matmul=matmul)
        dtype_name = str(dtype).removeprefix("torch.")
        if not_native is None:
            path = ExecutionPath("native", f"{device.type}, {dtype_name}, native_decode.c built", matmul, "native")
        elif device.type == "cuda" and config.cuda_graph_batch_sizes:
            from training.deployment.engine.runners.cuda_graphs import CudaGraphDecoder

            runner.graphs = CudaGraphDecoder(
                runner, config.cuda_graph_batch_sizes, config.max_batch_size, config.max_model_len
            )
            path = ExecutionPath(
                "cuda_graphs", f"cuda, {dtype_name}, batch sizes {list(config.cuda_graph_batch_sizes)}", matmul
            )
        else:
            path = ExecutionPath("torch", f"{device.type}, {dtype_name}: {not_native}", matmul)
    log.info("engine path: %s", path.describe())
    return runner, path
