"""The memory a run needs, part by part, per GPU and per host, before anything loads.

    python -m training.memory_plan path/to/train.py [key=value ...] [--gpus-per-node 8] [--gpu-gb 80] [--nodes 1]

reads the module-level ``cfg`` of a ``train.py`` (its ``__main__`` block does not run), applies the
overrides as ``train.py`` would, counts the model's parameters from its config alone (built on the
``meta`` device: nothing is downloaded beyond ``config.json``, no weights are read) and prints a table.
Without ``--gpus-per-node`` it plans for the visible GPUs, else for this host's memory (CPU). The
recipe calls ``plan_run`` at start: on CUDA it refuses a config that cannot fit, naming what to change,
turns activation checkpointing on where ``trainer.gradient_checkpointing`` is None and the run needs it, and gives a
colocated vLLM / SGLang left at its default share what the trainer leaves of each GPU.

Bytes per part (N parameters, W trainer ranks, b = the compute dtype's size, per token and decoder layer
with hidden size h, MLP size I, query width q = heads·head_dim, key / value width k = kv_heads·head_dim):

| part | bytes per trainer GPU |
| --- | --- |
| policy weights | 4·N / W (fp32 master shards); LoRA: the base in its dtype / W, the adapters in fp32 |
| gradients | 4·N / W (LoRA: the adapters' only) |
| optimizer | 8·N / W (AdamW's two fp32 moments; LoRA: the adapters'); 0 with ``offload_optimizer`` (host instead) |
| gathered layer | 2 · b · (one decoder layer's parameters): FSDP2's all-gather of the running layer and the next |
| reference | 2·N / W in bf16 (or 4·N in fp32 on CPU) when ``kl_beta > 0`` and no LoRA (LoRA: the base itself) |
| critic | 16·(h + 1) with ``advantage="gae"``: the value head's fp32 weights, gradient and AdamW moments (it reads the policy's hidden states in the same forward: no second model, no extra process) |
| activations | T · L · b · (6h + 2q + 2k + 4I, + 3q + 3k with per-head q / k norms) for T = ``micro_batch_tokens`` tokens (without checkpointing); with it T·L·b·h plus one layer's full set; and the LM-head chunk ``logprob_chunk_tokens``·V·4·3 |

| part | bytes per inference GPU |
| --- | --- |
| engine weights | N · (engine dtype size) / tensor-parallel size (the embedded engine) |
| KV pool | ``kv_cache_memory_bytes`` if set, else ``kv_cache_memory_fraction`` of the memory free after the weights (the embedded engine) |
| engine share | vLLM / SGLang: ``gpu_memory_fraction`` (else the backend's default, 0.9 / 0.88) of the GPU, weights and KV cache together (``training/utils/backends.py``); colocated with the trainer, the plan shows what that share leaves it |

Per host: the weight push's file (N · engine dtype size on /dev/shm, one per host), optimizer state offloaded
there, and on CPU every part above. The activation coefficients are a count of the tensors a
``transformers`` Llama / Qwen decoder layer keeps for backward (norm inputs and outputs, projection inputs,
the attention's q / k / v / output, the MLP's gate, up and product); ``tests/recipes/test_memory_plan.py``
checks them and the other parts against bytes measured on SmolLM2.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from training.utils.config import backend
from training.utils.engine_choice import resolve_engine

logger = logging.getLogger(__name__)

GB = 1e9
GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADROOM = 0.92
"""Share of a GPU's memory the plan lets a run fill (the rest: CUDA context, allocator fragmentation, NCCL)."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its parameter count and the sizes its activations scale with."""

    params: int
    layer_params: int
    layers: int
    hidden: int
    intermediate: int
    q_width: int
    kv_width: int
    vocab: int
    qk_norm: bool = False
    """Per-head norms of queries and keys (Qwen3): more tensors kept for backward."""

    @classmethod
    def of(cls, model: str) -> "ModelShape":
        """Count the parameters of ``model`` (a folder or hub id; only its ``config.json`` is read) built on ``meta``."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model)
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(config)
        built.tie_weights()  # transformers 5.0 leaves a tied head untied in from_config
        params = sum(p.numel() for p in built.parameters())
        layers = built.get_decoder().layers
        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(
            params=params,
            layer_params=sum(p.numel() for p in layers[0].parameters()),
            layers=len(layers),
            hidden=text.hidden_size,
            intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
            q_width=heads * head_dim,
            kv_width=kv_heads * head_dim,
            vocab=text.vocab_size,
            qk_norm=any("q_norm" in name for name, _ in layers[0].named_modules()),
        )

    def activation_bytes_per_token_layer(self, dtype_bytes: int) -> int:
        """Bytes one token keeps for backward in one decoder layer (module docstring's count)."""
        h, q, k, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return dtype_bytes * (6 * h + 2 * q + 2 * k + 4 * i + (3 * q + 3 * k if self.qk_norm else 0))


@dataclass
class Part:
    name: str
    gpu_bytes: float = 0.0
    """On each GPU that holds the part (a trainer rank's, or a replica's)."""
    host_bytes: float = 0.0
    """On each host."""
    where: str = "trainer"
    """``trainer`` or ``inference``: which GPUs hold it."""
    note: str = ""


@dataclass
class MemoryPlan:
    """The parts of a run's memory and whether they fit the devices planned for."""

    mode: str
    device: str
    gpu_bytes: Optional[float]
    host_bytes: float
    trainer_gpus: int
    inference_gpus: int
    colocated: bool
    parts: list[Part] = field(default_factory=list)

    def per_gpu(self, where: str) -> float:
        """Bytes on one GPU of ``where``; a colocated GPU holds both."""
        return sum(p.gpu_bytes for p in self.parts if self.colocated or p.where == where)

    def per_host(self) -> float:
        return sum(p.host_bytes for p in self.parts)

    def problems(self) -> list[str]:
        """What does not fit, each naming what to change; empty when the run fits."""
        out = []
        if self.gpu_bytes:
            limit = HEADROOM * self.gpu_bytes
            for where in ("trainer",) if self.colocated else ("trainer", "inference"):
                need = self.per_gpu(where)
                if need > limit:
                    biggest = max(
                        (p for p in self.parts if self.colocated or p.where == where), key=lambda p: p.gpu_bytes
                    )
                    out.append(
                        f"{'each colocated' if self.colocated else 'each ' + where} GPU needs {need / GB:.1f} GB of "
                        f"{limit / GB:.1f} GB usable (largest: {biggest.name}, {biggest.gpu_bytes / GB:.1f} GB); "
                        + _advice(biggest.name)
                    )
        elif self.per_host() > HEADROOM * self.host_bytes:
            out.append(f"this host needs {self.per_host() / GB:.1f} GB of {self.host_bytes / GB:.1f} GB")
        return out

    def table(self) -> str:
        gpu = f"{self.gpu_bytes / GB:.0f} GB GPUs" if self.gpu_bytes else "CPU"
        lines = [
            f"memory plan: {self.mode} fine-tuning, {self.trainer_gpus} trainer rank(s), {self.inference_gpus} "
            f"inference GPU(s){', colocated' if self.colocated else ''}, {gpu}, {self.host_bytes / GB:.0f} GB host",
            f"{'part':<22}{'per GPU':>12}{'per host':>12}  note",
        ]
        for p in self.parts:
            lines.append(f"{p.name:<22}{_gb(p.gpu_bytes):>12}{_gb(p.host_bytes):>12}  {p.note}")
        lines.append(f"{'trainer GPU total':<22}{_gb(self.per_gpu('trainer')):>12}")
        if not self.colocated and self.inference_gpus:
            lines.append(f"{'inference GPU total':<22}{_gb(self.per_gpu('inference')):>12}")
        lines.append(f"{'host total':<22}{'':>12}{_gb(self.per_host()):>12}")
        problems = self.problems()
        lines.append("fits" if not problems else "does not fit: " + "; ".join(problems))
        return "\n".join(lines)


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB" if x else "-"


def _advice(part: str) -> str:
    return {
        "activations": "set trainer.gradient_checkpointing=true or lower trainer.micro_batch_tokens",
        "optimizer": "use more trainer GPUs, trainer.offload_optimizer=true, or LoRA (trainer.lora_rank)",
        "policy weights": "use more trainer GPUs or LoRA (trainer.lora_rank)",
        "gradients": "use more trainer GPUs or LoRA (trainer.lora_rank)",
        "KV pool": "lower the KV pool (deployment.engine_config.kv_cache_memory_bytes or kv_cache_memory_fraction)",
        "engine share": "lower deployment.gpu_memory_fraction (the share of the GPU vLLM / SGLang take)",
        "engine weights": "use tensor parallelism for the replicas or a bf16 engine",
        "reference": "set kl_beta=0 or use LoRA (the reference is then the base itself)",
    }.get(part, "use more GPUs")


def plan_memory(
    cfg: Any,
    shape: Optional[ModelShape] = None,
    gpus_per_node: Optional[int] = None,
    gpu_bytes: Optional[float] = None,
    nodes: int = 1,
    host_bytes: Optional[float] = None,
) -> MemoryPlan:
    """The plan for the recipe config ``cfg`` (``async_rl_loop.Config`` or ``rl_loop.Config``) on the given devices
    (default: the visible GPUs, else this host's CPU)."""
    shape = shape or ModelShape.of(_model_path(cfg.base_model))
    if gpus_per_node is None:
        gpus_per_node, gpu_bytes = _visible_gpus()
    host_bytes = host_bytes or _host_bytes()
    trainer, deploy = cfg.trainer, cfg.deployment
    on_gpu = bool(gpus_per_node)
    colocated = bool(getattr(deploy, "colocate", False))
    replicas = 0 if getattr(deploy, "base_url", None) else max(1, int(getattr(deploy, "num_replicas", 1)))
    tp = max(1, len(getattr(deploy, "replica_devices", []) or []) // max(replicas, 1))
    total_gpus = gpus_per_node * nodes
    inference_gpus = replicas * tp if on_gpu else 0
    trainer_gpus = (total_gpus if colocated else max(total_gpus - inference_gpus, 1)) if on_gpu else 1
    w = trainer_gpus
    n = shape.params
    b = DTYPE_BYTES.get(_compute_dtype(trainer, on_gpu), 4)
    lora = getattr(trainer, "lora_rank", 0) > 0
    engine_b = DTYPE_BYTES.get(_engine_dtype(deploy, on_gpu), 4)
    parts: list[Part] = []

    def put(name: str, nbytes: float, where: str = "trainer", note: str = "", host_only: bool = False) -> None:
        if on_gpu and not host_only:
            parts.append(Part(name, gpu_bytes=nbytes, where=where, note=note))
        else:  # on CPU everything is host memory: one copy per rank on this host
            copies = 1 if host_only else (w if where == "trainer" else 1)
            parts.append(Part(name, host_bytes=nbytes * copies, where=where, note=note))

    if lora:
        adapters = _lora_params(shape, trainer.lora_rank)
        base_b = DTYPE_BYTES.get(_lora_base_dtype(trainer, on_gpu), 4)
        put(
            "policy weights",
            (n * base_b + adapters * 4) / w,
            note=f"frozen base + {adapters / 1e6:.1f} M adapter params",
        )
        put("gradients", adapters * 4 / w)
        trained = adapters
    else:
        put("policy weights", 4 * n / w, note="fp32 master shards")
        put("gradients", 4 * n / w)
        trained = n
    if getattr(trainer, "offload_optimizer", False) and on_gpu:
        put("optimizer", 8 * trained / w, host_only=True, note="AdamW moments offloaded to host")
    else:
        put("optimizer", 8 * trained / w, note="AdamW's two fp32 moments")
    if w > 1:
        put("gathered layer", 2 * b * shape.layer_params, note="FSDP2 all-gather of the running and next layer")
    if getattr(cfg, "loss", None) is not None and cfg.loss.kl_beta > 0 and not lora:
        put("reference", n * (2 if on_gpu else 4) / w, note="frozen copy of the start")
    if getattr(cfg, "advantage", None) == "gae":
        put("critic", 16 * (shape.hidden + 1), note="value head Linear(h, 1): fp32 weights, grad, AdamW moments")
    tokens = trainer.micro_batch_tokens
    per_token_layer = shape.activation_bytes_per_token_layer(b)
    checkpointing = bool(getattr(trainer, "gradient_checkpointing", False))
    if checkpointing:
        act = tokens * (shape.layers * b * shape.hidden + per_token_layer)
        note = f"{tokens} tokens, checkpointed per layer"
    else:
        act = tokens * shape.layers * per_token_layer
        note = f"{tokens} tokens, no checkpointing"
    act += trainer.logprob_chunk_tokens * shape.vocab * 4 * 3 + tokens * shape.hidden * 4 * 2
    put("activations", act, note=note)
    inference = "inference"
    facts = backend(deploy.engine)
    if "gpu_memory_fraction" in facts.memory_settings and on_gpu:  # the backend takes a share of the GPU, whole
        share = deploy.gpu_memory_fraction or facts.default_gpu_memory_fraction
        note = f"{deploy.engine}: weights, activations and KV cache in {share:g} of the GPU (gpu_memory_fraction)"
        put("engine share", share * gpu_bytes, where=inference, note=note)
    else:
        put("engine weights", n * engine_b / tp, where=inference, note=f"{_engine_dtype(deploy, on_gpu)}, tp {tp}")
        kv = _kv_bytes(deploy.engine_config, (gpu_bytes if on_gpu else host_bytes) - n * engine_b / tp)
        put("KV pool", kv, where=inference, note="engine_config.kv_cache_memory_bytes / _fraction of the free memory")
    parts.append(Part("push staging", host_bytes=n * engine_b, note="one weights file per host on /dev/shm"))
    return MemoryPlan(
        mode="LoRA" if lora else "full",
        device="cuda" if on_gpu else "cpu",
        gpu_bytes=gpu_bytes if on_gpu else None,
        host_bytes=host_bytes,
        trainer_gpus=trainer_gpus if on_gpu else 0,
        inference_gpus=inference_gpus,
        colocated=colocated,
        parts=parts,
    )


def plan_run(cfg: Any, model_path: str) -> Any:
    """At the start of a run: ``cfg`` with ``trainer.gradient_checkpointing`` decided where it is None (on CUDA: on
    only when the plan does not fit without it; on CPU: off), after checking on CUDA that the plan fits the visible
    GPUs, else ``ConfigError`` naming what to change. The plan's table is logged once. Host memory (CPU runs) is not
    checked. Where the model's config cannot be read the load itself says what is wrong, so nothing is checked."""
    from training.utils.config import ConfigError

    gpus, gpu_bytes = _visible_gpus()
    checkpointing = cfg.trainer.gradient_checkpointing
    if not gpus:
        return (
            cfg
            if checkpointing is not None
            else replace(cfg, trainer=replace(cfg.trainer, gradient_checkpointing=False))
        )
    try:
        shape = ModelShape.of(model_path)
    except Exception as exc:
        logger.info("memory plan: skipped (%s)", exc)
        return cfg
    choices = [checkpointing] if checkpointing is not None else [False, True]
    for choice in choices:
        decided = replace(cfg, trainer=replace(cfg.trainer, gradient_checkpointing=choice))
        decided = _colocated_share(decided, shape, gpus, gpu_bytes)
        plan = plan_memory(decided, shape=shape, gpus_per_node=gpus, gpu_bytes=gpu_bytes)
        if not plan.problems():
            break
    logger.info("%s", plan.table())
    if plan.problems():
        raise ConfigError("memory plan: " + "; ".join(plan.problems()) + " (python -m training.memory_plan train.py)")
    if checkpointing is None and choice:
        logger.info("memory plan: activation checkpointing on (the run does not fit without it)")
    return decided


def _colocated_share(cfg: Any, shape: ModelShape, gpus: int, gpu_bytes: float) -> Any:
    """A colocated vLLM / SGLang left at its default share (``gpu_memory_fraction`` None) gets what the trainer's
    parts leave of each GPU's usable memory (rounded down to 0.01), logged; otherwise ``cfg`` unchanged."""
    deploy = cfg.deployment
    facts = backend(deploy.engine)
    if (
        not deploy.colocate
        or deploy.gpu_memory_fraction is not None
        or "gpu_memory_fraction" not in facts.memory_settings
    ):
        return cfg
    plan = plan_memory(cfg, shape=shape, gpus_per_node=gpus, gpu_bytes=gpu_bytes)
    trainer = sum(p.gpu_bytes for p in plan.parts if p.where == "trainer")
    share = math.floor(100 * (HEADROOM * gpu_bytes - trainer) / gpu_bytes) / 100
    if share <= 0:
        return cfg  # nothing is left: the plan's refusal says what to change
    logger.info(
        "memory plan: the colocated %s takes %.2f of each GPU (deployment.gpu_memory_fraction)", deploy.engine, share
    )
    return replace(cfg, deployment=replace(deploy, gpu_memory_fraction=share))


def _model_path(model: str) -> str:
    from training.models import resolve_model

    return resolve_model(model)


def _visible_gpus() -> tuple[int, Optional[float]]:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return 0, None
    return torch.cuda.device_count(), float(torch.cuda.get_device_properties(0).total_memory)


def _host_bytes() -> float:
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _param_dtype(trainer: Any) -> str:
    return "float32" if trainer.dtype == "auto" else trainer.dtype


def _lora_base_dtype(trainer: Any, on_gpu: bool) -> str:
    """The frozen base's dtype under LoRA: ``trainer.dtype`` when set, else the compute dtype (trainer.py)."""
    return trainer.dtype if trainer.dtype != "auto" else _compute_dtype(trainer, on_gpu)


def _compute_dtype(trainer: Any, on_gpu: bool) -> str:
    if trainer.compute_dtype != "auto":
        return trainer.compute_dtype
    return "bfloat16" if on_gpu else _param_dtype(trainer)


def _engine_dtype(deploy: Any, on_gpu: bool) -> str:
    dtype = deploy.engine_config.dtype
    return ("bfloat16" if on_gpu else "float32") if dtype == "auto" else dtype


def _kv_bytes(engine: Any, free_bytes: float) -> float:
    """The embedded engine's KV pool: ``kv_cache_memory_bytes``, else its fraction of the memory free after the
    weights (``KVBudget``)."""
    if engine.kv_cache_memory_bytes:
        return float(engine.kv_cache_memory_bytes)
    return engine.kv_cache_memory_fraction * max(free_bytes, 0.0)


def _lora_params(shape: ModelShape, rank: int) -> int:
    """Adapter parameters on every linear of the decoder: r·(in + out) per projection."""
    h, i, q, k = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
    per_layer = rank * ((h + q) + 2 * (h + k) + (q + h) + 2 * (h + i) + (i + h))
    return shape.layers * per_layer


def load_train_config(train_py: str, overrides: list[str]) -> Any:
    """The module-level ``cfg`` of ``train_py`` (imported without running its ``__main__`` block), overridden."""
    from training.utils.cli import apply_overrides

    path = Path(train_py).resolve()
    if not path.is_file():
        raise SystemExit(f"{train_py}: no such file")
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("_memory_plan_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "cfg"):
        raise SystemExit(f"{train_py}: no module-level `cfg` to plan for")
    return apply_overrides(module.cfg, overrides)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.memory_plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("train_py", help="the run's train.py (its module-level cfg)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as train.py takes them")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="plan for this many GPUs per node")
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="memory of each GPU in GB (with --gpus-per-node)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--host-gb", type=float, default=None, help="memory of each host in GB (default: this one's)")
    args = parser.parse_args(argv)
    cfg = load_train_config(args.train_py, args.overrides)
    deployment, choice = resolve_engine(cfg.deployment, num_gpus=args.gpus_per_node)
    cfg = replace(cfg, deployment=deployment)
    if choice.line:
        print(choice.line)
    gpu_bytes = args.gpu_gb * GB if args.gpus_per_node else None
    host = args.host_gb * GB if args.host_gb else None
    plan = plan_memory(cfg, gpus_per_node=args.gpus_per_node, gpu_bytes=gpu_bytes, nodes=args.nodes, host_bytes=host)
    print(plan.table())
    if plan.problems():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
