"""LoRA adapters on the policy (``TrainerConfig.lora_rank > 0``), with ``peft``.

``apply_lora`` injects ``peft`` LoRA layers into the loaded ``transformers`` model in place
(``peft.inject_adapter_in_model``: the model keeps its class, its ``config`` and its
``get_decoder`` / ``get_output_embeddings``, so packing, chunked logprobs and FSDP2 run
unchanged) and freezes everything but the adapters. For a targeted linear layer with weight
``W`` ``[out, in]``::

    y = x W^T + s · (x A^T) B^T,   A [r, in], B [out, r], s = lora_alpha / r

``B`` starts at 0, so the adapted policy starts equal to the base model.

What leaves the trainer is always merged, ``W' = W + s · B A``, under the base model's own
names (``export_plan`` → ``PolicyTrainer.named_weights``): weight sync, the engine and vLLM need
no adapter support. ``save_adapters`` writes the adapters alone in ``peft``'s folder format
(``PeftModel.from_pretrained(base, folder)`` loads it). ``adapters_disabled`` runs the base
model (the reference for the KL penalty, without a second copy of the weights).

Why ``peft``: it is the standard implementation (initialisation, every linear-layer type, the
adapter file format that serving engines read); what it does not do for us here (merged
weights one tensor at a time under FSDP2, the base model's names) is ``export_plan``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

ADAPTER_NAME = "default"
"""The one adapter the trainer injects."""


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name → ``peft`` LoRA layer, for every layer holding our adapter (none without ``peft``)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER_NAME in m.lora_A}


def lora_config(cfg) -> "peft.LoraConfig":  # noqa: F821
    """The ``peft.LoraConfig`` of a ``TrainerConfig``."""
    from peft import LoraConfig

    targets = list(cfg.lora_target_modules)
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        bias="none",
        target_modules=targets[0] if targets == ["all-linear"] else targets,
    )


def apply_lora(model: torch.nn.Module, cfg, adapter_dtype: torch.dtype = torch.float32) -> int:
    """Inject LoRA (rank ``cfg.lora_rank``) into ``model`` in place, freeze the rest; return the trainable count.

    The adapters are held in ``adapter_dtype`` (the trainer's parameter dtype: fp32, the copy AdamW updates) whatever
    the base's dtype: a bf16 base (the trainer's default on CUDA) would otherwise give bf16 adapters, whose small
    updates round away. The forward runs under the trainer's autocast, so the two dtypes meet in its matmuls.

    Only linear layers are supported (``W + s·BA`` is merged by ``export_plan``); a target that
    names another kind of layer, or matches nothing, is an error naming ``lora_target_modules``.
    """
    try:
        from peft import inject_adapter_in_model
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError as e:  # pragma: no cover - the extra is installed by scripts/setup.sh
        raise ImportError("lora_rank > 0 needs peft: pip install -e '.[lora]'") from e

    model.requires_grad_(False)
    try:
        inject_adapter_in_model(lora_config(cfg), model, adapter_name=ADAPTER_NAME)
    except ValueError as e:
        raise ValueError(f"lora_target_modules: {list(cfg.lora_target_modules)} - {e}") from e
    layers = _lora_layers(model)
    if not layers:
        raise ValueError(f"lora_target_modules: {list(cfg.lora_target_modules)} matched no layer of this model")
    for name, layer in layers.items():
        if not isinstance(layer, LoraLinear):
            raise ValueError(
                f"lora_target_modules: {name} is a {type(layer.get_base_layer()).__name__}; "
                "only linear layers are supported"
            )
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.to(adapter_dtype)
    return sum(p.numel() for p in trainable)


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as the base model inside the block (every LoRA layer skips its adapter).

    Sets ``peft``'s per-layer flag directly: ``enable_adapters(False)`` would also flip the
    adapters' ``requires_grad``, which the optimizer and FSDP2 must not see change.
    """
    layers = list(_lora_layers(model).values())
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


@dataclass(frozen=True)
class LoraMerge:
    """How to merge one weight: ``W + scaling · B A`` (transposed for ``fan_in_fan_out`` layers)."""

    a_key: str
    """``state_dict`` key of ``A`` ``[r, in]``."""
    b_key: str
    """``state_dict`` key of ``B`` ``[out, r]``."""
    scaling: float
    fan_in_fan_out: bool


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, merge: LoraMerge) -> torch.Tensor:
    """``W + s · B A`` in fp32, returned in ``W``'s dtype (all arguments whole tensors)."""
    delta = (b.float() @ a.float()) * merge.scaling
    if merge.fan_in_fan_out:
        delta = delta.T
    return (weight.float() + delta).to(weight.dtype)


def export_plan(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor]
) -> dict[str, tuple[str, Optional[LoraMerge]]]:
    """Base-model name → (``state_dict`` key of the tensor, how to merge it or None), adapters left out.

    ``…q_proj.base_layer.weight`` becomes ``…q_proj.weight`` (merged with that layer's ``A``, ``B``),
    ``…q_proj.base_layer.bias`` becomes ``…q_proj.bias``; ``lora_*`` entries are dropped. Keys
    are ``state_dict``'s, so the plan works on a sharded state dict too.
    """
    merges = {}
    for name, layer in _lora_layers(model).items():
        merges[f"{name}.base_layer.weight"] = LoraMerge(
            f"{name}.lora_A.{ADAPTER_NAME}.weight",
            f"{name}.lora_B.{ADAPTER_NAME}.weight",
            float(layer.scaling[ADAPTER_NAME]),
            bool(getattr(layer, "fan_in_fan_out", False)),
        )
    plan = {}
    for key in state_dict:
        if ".lora_" in key:
            continue
        plan[key.replace(".base_layer.", ".")] = (key, merges.get(key))
    return plan


def adapter_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    """``peft`` file name of each adapter tensor (``base_model.model.<module>.lora_A.weight``) → ``state_dict`` key."""
    suffix = f".{ADAPTER_NAME}.weight"
    return {
        "base_model.model." + key[: -len(suffix)] + ".weight": key
        for key in state_dict
        if ".lora_" in key and key.endswith(suffix)
    }


def save_adapters(cfg, tensors: dict[str, torch.Tensor], out_dir: Union[str, Path], base_model: str = "") -> Path:
    """Write ``tensors`` (from ``adapter_state_dict``, whole, on CPU) as a ``peft`` adapter folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = lora_config(cfg)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(out))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    return out
