"""Loading a causal LM for training: attention choice, dropout off (devices: ``training/utils/device.py``).

Attention: the default is ``packed_sdpa``, registered here with ``transformers``'
``AttentionInterface``. On a packed micro-batch (the trainer passes ``cu_seq_lens_q``, the
cumulative sequence lengths) it runs ``scaled_dot_product_attention`` causally on each
sequence separately, costing sum(L_i^2) instead of N^2 for a dense block-diagonal mask. In
every other case (no ``cu_seq_lens_q``, a sliding-window layer, a KV cache) it is exactly
``transformers``' ``sdpa`` with the mask ``transformers`` built.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from training.utils.device import resolve_device, resolve_dtype  # noqa: F401 - re-exported

PACKED_SDPA = "packed_sdpa"
"""Name of the per-sequence attention implementation registered with ``transformers``."""


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, cu_seq_lens_q: Optional[torch.Tensor] = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over ``[B, H, N, D]`` inputs; returns ``[B, N, H, D]`` like ``transformers``' kernels.

    With ``cu_seq_lens_q`` (``[S + 1]`` boundaries of the packed sequences), full-attention
    layers and no cache, each sequence attends causally to itself only.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sliding = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if cu_seq_lens_q is None or sliding or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    bounds = cu_seq_lens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q: must run from 0 to {query.shape[2]}, got {bounds[0]}..{bounds[-1]}")
    gqa = query.shape[1] != key.shape[1]
    outputs = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                       scale=scaling, is_causal=True, enable_gqa=gqa)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def register_packed_sdpa() -> None:
    """Register ``packed_sdpa`` (attention and its mask builder, the same as ``sdpa``'s) with ``transformers``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0.

    RL needs the trainer's logprob of a token under given weights to be a function of the
    weights only (so that ``exp(l - l_old) == 1`` before the first update), and the policy is
    run in train mode when gradient checkpointing is on.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout", "hidden_dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in list(vars(config).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(config, key, 0.0)


def load_causal_lm(path_or_hub_id: str, device: Union[str, torch.device], dtype: torch.dtype,
                   gradient_checkpointing: bool = False, **kwargs: Any) -> torch.nn.Module:
    """Load ``AutoModelForCausalLM`` from a local folder or a hub id onto ``device`` in ``dtype``.

    Extra keyword arguments (``gguf_file=``, ``revision=``, ``attn_implementation=``...) go to
    ``from_pretrained``. Attention defaults to ``packed_sdpa`` (see the module docstring); ``sdpa``
    and ``eager`` get a block-diagonal 4-D mask, flash-attention the boundaries. Dropout is
    switched off (see ``disable_dropout``).
    """
    from transformers import AutoModelForCausalLM

    register_packed_sdpa()
    kwargs.setdefault("attn_implementation", PACKED_SDPA)
    model = AutoModelForCausalLM.from_pretrained(path_or_hub_id, dtype=dtype, **kwargs)
    model.to(torch.device(device))
    disable_dropout(model)
    if gradient_checkpointing:
        checkpointing_kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
        if hasattr(model.config, "use_cache"):
            model.config.use_cache = False
    return model


def attention_implementation(model: torch.nn.Module) -> str:
    """The attention implementation the loaded model runs with (``packed_sdpa``, ``sdpa``, ``eager``, ``flash_attention_2``...)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")
