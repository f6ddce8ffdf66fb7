"""Loading a causal LM for training: attention choice, dropout off (devices: ``training/utils/device.py``).

Attention: the default is ``packed_sdpa``, registered here with ``transformers``'
``AttentionInterface``. On a packed micro-batch (the trainer passes ``cu_seq_lens_q``, the
cumulative sequence lengths) it runs ``scaled_dot_product_attention`` causally on each
sequence separately, costing sum(L_i^2) instead of N^2 for a dense block-diagonal mask. In
every other case (no ``cu_seq_lens_q``, a sliding-window layer, a KV cache) it is exactly
``transformers``' ``sdpa`` with the mask ``transformers`` built.

Shared prompts: given ``shared_prefix_layout`` (a ``SharedPrefixLayout``, see
``prefix_sharing.py``) it runs one ``sdpa`` per span of the compute row: a prefix or a plain
sequence causally on itself, a member's suffix on the prefix's keys plus its own (mask: all of
the prefix, its own keys causally). That is exact only where every layer is full attention
(``prefix_sharing_supported``); a sliding-window layer given a layout is an error, never a
silent fallback.

Kernels: every call goes through ``attend``, which never hands SDPA an explicit mask together with
fewer KV heads than query heads (``enable_gqa``). On CUDA no fused kernel takes that pair, so SDPA
would fall back to the math kernel, which keeps fp32 ``[heads, Lq, Lk]`` scores for backward. The
rule, by call:

| call | GQA model | kernel it can get |
| --- | --- | --- |
| causal, no mask (a sequence, a prefix) | ``enable_gqa`` (flash takes it) on CPU, and on CUDA in bf16 / fp16; KV heads repeated on CUDA in fp32 (memory-efficient) | flash or memory-efficient |
| masked (a member's suffix over prefix + itself) | KV heads repeated to the query heads, no ``enable_gqa`` | memory-efficient (CUDA), flash (CPU) |

The repeat costs one ``[B, H, Lk, D]`` copy of the span's keys and values, a small fraction of
the scores the math kernel would keep. The packed path takes the sequence lengths as Python ints
(``packed_lengths``, from the trainer) so no layer reads ``cu_seq_lens_q`` back from the device.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from training.utils.device import resolve_device, resolve_dtype  # noqa: F401 - re-exported

PACKED_SDPA = "packed_sdpa"
"""Name of the per-sequence attention implementation registered with ``transformers``."""


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over ``[B, H, N, D]`` inputs; returns ``[B, N, H, D]`` like ``transformers``' kernels.

    With ``cu_seq_lens_q`` (``[S + 1]`` boundaries of the packed sequences), full-attention
    layers and no cache, each sequence attends causally to itself only. On CPU, bf16 / fp16 inputs
    (autocast, ``TrainerConfig.compute_dtype``) are attended in fp32 and the output cast back:
    torch's CPU attention kernels ran forward and backward 3-6x slower in bf16 than in fp32 at
    these lengths (SmolLM2 heads, 50-200 tokens), and attention is a small share of the FLOPs.
    """
    half = (torch.bfloat16, torch.float16)
    low_precision = any(t.dtype in half for t in (query, key, value)) or torch.is_autocast_enabled(query.device.type)
    if query.device.type != "cpu" or not low_precision:
        return _packed_sdpa(module, query, key, value, attention_mask, dropout, scaling, cu_seq_lens_q, **kwargs)
    out_dtype = value.dtype if value.dtype in half else torch.get_autocast_dtype("cpu")
    query, key, value = query.float(), key.float(), value.float()
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):  # autocast would cast the inputs back to its dtype
        output, _ = _packed_sdpa(module, query, key, value, attention_mask, dropout, scaling, cu_seq_lens_q, **kwargs)
    return output.to(out_dtype), None


def _packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float,
    scaling: Optional[float],
    cu_seq_lens_q: Optional[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``packed_sdpa_attention`` in the inputs' dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sliding = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    layout = kwargs.pop("shared_prefix_layout", None)
    if layout is not None:
        if sliding or query.shape[2] != key.shape[2] or query.shape[2] != layout.num_compute_tokens:
            raise ValueError(
                "shared_prefix_layout: needs full attention over the whole compute row without a cache "
                f"(sliding_window={sliding}, query {query.shape[2]}, key {key.shape[2]} rows, "
                f"layout {layout.num_compute_tokens})"
            )
        return _shared_prefix_attention(query, key, value, layout, dropout, scaling), None
    if cu_seq_lens_q is None or sliding or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    sizes = kwargs.get("packed_lengths")
    if sizes is None:  # a caller that passed only the boundaries: read them (a device sync on CUDA)
        bounds = cu_seq_lens_q.tolist()
        if bounds[0] != 0:
            raise ValueError(f"cu_seq_lens_q: must start at 0, got {bounds[0]}")
        sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if sum(sizes) != query.shape[2]:
        raise ValueError(f"packed sequence lengths: must add up to {query.shape[2]} rows, got {sum(sizes)}")
    outputs = [
        attend(q, k, v, dropout=dropout, scale=scaling)
        for q, k, v in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2))
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    dropout: float = 0.0,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``[B, H, Lq, D]`` queries over ``[B, H_kv, Lk, D]`` keys:
    causal without ``mask``, else under the boolean ``mask``; KV heads repeated where a fused kernel
    needs it (the table in the module docstring)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        half = query.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(query.device.type)
        if mask is not None or (query.device.type == "cuda" and not half):
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
            groups = 1
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        scale=scale,
        is_causal=mask is None,
        enable_gqa=groups > 1,
    )


def _shared_prefix_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Any, dropout: float, scaling: Optional[float]
) -> torch.Tensor:
    """``[B, H, C, D]`` inputs over the spans of ``layout`` → ``[B, C, H, D]`` (see the module docstring).

    The spans' rows are taken with one ``split`` per input, not a slice per span: the backward of a
    split is one concatenation, where each slice's backward would fill a whole-row zero tensor.
    """
    layout.attention_calls += 1
    sizes = [span.end - span.start for span in layout.spans]
    queries, keys, values = query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2)
    by_rows = {(span.start, span.end): i for i, span in enumerate(layout.spans)}
    outputs = []
    for i, (span, mask) in enumerate(zip(layout.spans, layout.span_masks)):
        if mask is None:
            outputs.append(attend(queries[i], keys[i], values[i], dropout=dropout, scale=scaling))
            continue
        c, d = span.context_start, span.context_end
        j = by_rows.get((c, d))  # the context is the shared prefix, itself a span
        context_k = keys[j] if j is not None else key[:, :, c:d]
        context_v = values[j] if j is not None else value[:, :, c:d]
        outputs.append(
            attend(
                queries[i],
                torch.cat([context_k, keys[i]], dim=2),
                torch.cat([context_v, values[i]], dim=2),
                mask=mask,
                dropout=dropout,
                scale=scaling,
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def prefix_sharing_supported(model: torch.nn.Module) -> tuple[bool, str]:
    """Whether shared-prompt packing is exact for ``model``, and why not.

    It needs ``packed_sdpa`` attention (the only kernel that reads the layout) and full
    attention in every layer: with a sliding window a suffix token may not see the whole
    prefix, which the shared layout assumes (Mistral-style ``sliding_window``, Gemma's or
    gpt-oss's alternating ``sliding_attention`` layers). Architectures whose layers mix tokens
    by other means (state-space or linear-attention layers) are refused too, as far as the
    config says so (``layer_types`` other than ``full_attention``).
    """
    config = model.config
    impl = attention_implementation(model)
    if impl != PACKED_SDPA:
        return False, f"attention is {impl!r}, not {PACKED_SDPA!r}"
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            return False, f"layer_types include {other}"
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False, f"sliding_window={config.sliding_window}"
    return True, ""


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


def load_causal_lm(
    path_or_hub_id: str,
    device: Union[str, torch.device],
    dtype: torch.dtype,
    gradient_checkpointing: bool = False,
    **kwargs: Any,
) -> torch.nn.Module:
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
    return prepare_for_training(model, gradient_checkpointing)


def prepare_for_training(model: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """Dropout off (``disable_dropout``) and, when asked, activation checkpointing per decoder layer (no KV cache);
    in place, on a loaded model or one still on the ``meta`` device."""
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
    """The attention implementation the loaded model runs with (``packed_sdpa``, ``sdpa``, ``eager``,
    ``flash_attention_2``...)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes named in ``_no_split_modules``, else ``decoder.layers``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        layers = list(getattr(model.get_decoder(), "layers", []))
    return layers
