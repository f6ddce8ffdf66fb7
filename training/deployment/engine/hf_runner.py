"""Fallback runner: the plain transformers forward, for architectures the lean forward lacks.

Same interface as :class:`~training.deployment.engine.model_runner.LeanModelRunner`
(``prefill``, ``decode``, ``copy_kv``, ``load_weights``, ``weights_changed``, ``cache``, ``weight_shapes``, ``tied``,
``vocab_size``, ``targets``). K/V lives in the engine's slot :class:`KVCache`, handed to the model
as a transformers ``Cache`` (``SlotCache``) whose ``update`` writes the new K/V at each row's
(slot, position) and returns the keys to attend. So the fallback shares continuous batching
(one batched forward per decode step), prefix caching and compaction with the lean runner.

Masks are built here as 4-D additive masks (transformers uses a 4-D mask as given): row ``b``
sees its keys ``0 .. position_b``; with a ``sliding_window`` in the config, only the last
``sliding_window`` of them on sliding layers (``layer_types``) or on every layer (Mistral-style).
Needs a model whose attention layers call ``cache.update`` with ``[batch, kv_heads, tokens, head_dim]``
K/V of one shape on every layer (decoder-only transformers; not linear-attention hybrids).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Mapping, Optional

import torch

from training.deployment.engine.kv_cache import KVCache
from training.deployment.engine.model_runner import PrefillItem
from training.deployment.engine.weights import checkpoint_shapes


def _slot_cache_class():
    from transformers import Cache

    class SlotCache(Cache):
        """A transformers ``Cache`` over the engine's slot tensors for one forward.

        ``rows``: flat (slot, kv head, position) indices the new K/V go to (one per token and head),
        ``attend``: (slot start, slot stop, keys) of the cache block the batch attends to.
        ``probe`` instead records each layer's K/V shape and attends to the new K/V alone.
        """

        def __init__(self, cache: Optional[KVCache]):
            super().__init__(layers=[])
            self.kv = cache
            self.rows: Optional[torch.Tensor] = None
            self.attend: tuple[int, int, int] = (0, 0, 0)
            self.shapes: list[tuple[int, ...]] = []

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.kv is None:  # probing
                self.shapes.append((tuple(key_states.shape), tuple(value_states.shape)))
                return key_states, value_states
            k, v = self.kv.k[layer_idx], self.kv.v[layer_idx]
            k.view(-1, k.shape[-1])[self.rows] = key_states.transpose(1, 2).reshape(-1, k.shape[-1])
            v.view(-1, v.shape[-1])[self.rows] = value_states.transpose(1, 2).reshape(-1, v.shape[-1])
            a, b, n = self.attend
            return k[a:b, :, :n], v[a:b, :, :n]

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.attend[2]

    return SlotCache


class HFModelRunner:
    """transformers ``AutoModelForCausalLM`` over the slot :class:`KVCache`, decode steps batched."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, num_slots: int, max_model_len: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.device, self.dtype = device, dtype
        self.config = self.model.config
        self.vocab_size = self.config.vocab_size
        params = dict(self.model.named_parameters())
        if Path(path).exists():
            self.weight_shapes = checkpoint_shapes(path)
        else:  # hub id: the parameters' own names
            self.weight_shapes = {n: tuple(p.shape) for n, p in params.items()}
        self.tied = (
            bool(getattr(self.config, "tie_word_embeddings", False)) and "lm_head.weight" not in self.weight_shapes
        )
        state = self.model.state_dict()
        unknown = sorted(set(self.weight_shapes) - set(state))
        if unknown:
            raise ValueError(f"checkpoint tensor {unknown[0]} is not in the transformers model")
        self._targets = {n: state[n] for n in self.weight_shapes}
        self._slot_cache = _slot_cache_class()
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.max_len = max_model_len
        self.sliding_window = (
            getattr(self.config, "sliding_window", None)
            if getattr(self.config, "use_sliding_window", True) is not False
            else None
        )
        self.layer_types = getattr(self.config, "layer_types", None)
        self.cache = self._allocate_cache(num_slots, max_model_len)

    @property
    def targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint name → the parameter tensor a new value is copied into (in place)."""
        return self._targets

    @torch.inference_mode()
    def _allocate_cache(self, num_slots: int, max_model_len: int) -> KVCache:
        """Probe one token through the model for the per-layer K/V shapes, then allocate the slot cache."""
        probe = self._slot_cache(None)
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._forward(one, one, probe, self._mask(one, 1))
        if not probe.shapes or len({s for s in probe.shapes}) != 1:
            raise ValueError(
                f"the transformers fallback needs the same K/V shape on every attention layer; "
                f"{type(self.model).__name__} reported {sorted(set(probe.shapes))[:3]}"
            )
        (_, kv_heads, _, head_dim), (_, _, _, v_head_dim) = probe.shapes[0]
        return KVCache(
            len(probe.shapes),
            num_slots,
            kv_heads,
            max_model_len,
            head_dim,
            self.dtype,
            self.device,
            v_head_dim=v_head_dim,
        )

    @torch.inference_mode()
    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a validated full set into the model's parameters in place."""
        for name, target in self._targets.items():
            target.copy_(tensors[name])

    def weights_changed(self) -> None:
        """Nothing is derived from the parameters here (the lean runner refreshes its oneDNN copies)."""

    def copy_kv(self, src: int, dst: int, n: int) -> None:
        """K/V positions ``[0, n)`` of slot ``src`` into slot ``dst`` (prefix reuse, compaction)."""
        self.cache.copy(src, dst, n)

    # ----------------------------------------------------------------- forward
    def _mask(self, query_pos: torch.Tensor, key_len: int):
        """Additive mask [rows, 1, queries, keys]: key j visible to a query at p iff j <= p (and p - j < window)."""
        keys = torch.arange(key_len, device=self.device)
        p = query_pos[:, :, None]
        full = keys <= p
        masks = {"full_attention": full}
        if self.sliding_window:
            masks["sliding_attention"] = full & (p - keys < self.sliding_window)
        neg = torch.finfo(self.dtype).min
        additive = {
            k: torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill_(~m, neg)[:, None]
            for k, m in masks.items()
        }
        if self.layer_types is not None:
            return additive
        return additive["sliding_attention" if self.sliding_window else "full_attention"]

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, mask) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1].float()

    def _rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat (slot, kv head, position) row of each token's K/V in a layer's cache, token-major then head."""
        kh = self.cache.k[0].shape[1]
        heads = torch.arange(kh, device=self.device)
        return (((slots * kh)[:, None] + heads[None, :]) * self.max_len + positions[:, None]).reshape(-1)

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        """One forward per item (its new tokens, attending to its slot's cached prefix); last logits [n, V]."""
        out = []
        for it in items:
            n, p = len(it.token_ids), it.start_pos
            pos = torch.arange(p, p + n, device=self.device)
            cache = self._slot_cache(self.cache)
            cache.rows = self._rows(torch.full((n,), it.slot, device=self.device), pos)
            cache.attend = (it.slot, it.slot + 1, p + n)
            ids = torch.tensor([it.token_ids], device=self.device)
            out.append(self._forward(ids, pos[None], cache, self._mask(pos[None], p + n))[0])
        return torch.stack(out)

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int], shared_prefixes=()) -> torch.Tensor:
        """One batched forward: token ``i`` at ``positions[i]`` of ``slots[i]``; logits [B, V] (``shared_prefixes``: unused).

        Slots must be ``0 .. B-1`` (the engine keeps running sequences compact), so the batch
        attends to the cache block ``[:B]`` as it is, without gathering rows.
        """
        if slots != list(range(len(slots))):
            raise ValueError("HFModelRunner.decode needs compact slots 0..B-1")
        b = len(slots)
        pos = torch.tensor(positions, device=self.device)
        cache = self._slot_cache(self.cache)
        cache.rows = self._rows(torch.arange(b, device=self.device), pos)
        key_len = int(pos.max()) + 1
        cache.attend = (0, b, key_len)
        ids = torch.tensor(tokens, device=self.device)[:, None]
        return self._forward(ids, pos[:, None], cache, self._mask(pos[:, None], key_len))
