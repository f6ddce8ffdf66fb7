"""Fallback runner: the plain transformers forward, for architectures the lean forward lacks.

Same interface as :class:`~training.deployment.engine.runners.lean.LeanModelRunner`
(``prefill``, ``decode``, ``copy_block``, ``load_weights``, ``weights_changed``, ``cache``, ``weight_shapes``, ``tied``,
``vocab_size``, ``targets``). K/V lives in the engine's block pool (:class:`KVCache`), handed to the
model as a transformers ``Cache`` (``BlockCache``) whose ``update`` writes the new K/V at each token's
KV slot and returns the keys of the rows' blocks (gathered) to attend. So the fallback shares
continuous batching (one batched forward per decode step), prefix caching and preemption with the
lean runner.

Masks are built here as 4-D additive masks (transformers uses a 4-D mask as given): row ``b``
sees its keys ``0 .. position_b`` (the gathered keys past it, to the end of its last block, are masked); with a ``sliding_window`` in the config, only the last
``sliding_window`` of them on sliding layers (``layer_types``) or on every layer (Mistral-style).
Needs a model whose attention layers call ``cache.update`` with ``[batch, kv_heads, tokens, head_dim]``
K/V of one shape on every layer (decoder-only transformers; not linear-attention hybrids).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Mapping, Optional

import torch

from training.deployment.engine.kv_cache import KVBudget, KVCache, padded_tables
from training.deployment.engine.runners.lean import PrefillItem
from training.deployment.engine.weights import checkpoint_shapes


def _block_cache_class():
    from transformers import Cache

    class BlockCache(Cache):
        """A transformers ``Cache`` over the engine's block pool for one forward.

        ``rows``: flat rows (``KVCache.flat_rows``) the new K/V go to, one per token and head;
        ``tables``: block tables [R, W] of the rows the batch attends to (their keys are gathered).
        ``probe`` (no pool) instead records each layer's K/V shape and attends to the new K/V alone.
        """

        def __init__(self, cache: Optional[KVCache]):
            super().__init__(layers=[])
            self.kv = cache
            self.rows: Optional[torch.Tensor] = None
            self.tables: Optional[torch.Tensor] = None
            self.shapes: list[tuple[int, ...]] = []

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.kv is None:  # probing
                self.shapes.append((tuple(key_states.shape), tuple(value_states.shape)))
                return key_states, value_states
            self.kv.write(layer_idx, self.rows, key_states.transpose(1, 2), value_states.transpose(1, 2))
            return self.kv.gather(layer_idx, self.tables)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            if self.tables is None:  # probing (transformers 5.0 asks before every forward)
                return 0
            return self.tables.shape[1] * self.kv.block_size

    return BlockCache


class HFModelRunner:
    """transformers ``AutoModelForCausalLM`` over the block pool (:class:`KVCache`), decode steps batched."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, budget: KVBudget, max_model_len: int):
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
        self._block_cache = _block_cache_class()
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.max_len = max_model_len
        self.sliding_window = (
            getattr(self.config, "sliding_window", None)
            if getattr(self.config, "use_sliding_window", True) is not False
            else None
        )
        self.layer_types = getattr(self.config, "layer_types", None)
        self.cache = self._allocate_cache(budget)

    @property
    def targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint name → the parameter tensor a new value is copied into (in place)."""
        return self._targets

    @torch.inference_mode()
    def _allocate_cache(self, budget: KVBudget) -> KVCache:
        """Probe one token through the model for the per-layer K/V shapes, then allocate the block pool."""
        probe = self._block_cache(None)
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._forward(one, one, probe, self._mask(one, 1))
        if not probe.shapes or len({s for s in probe.shapes}) != 1:
            raise ValueError(
                f"the transformers fallback needs the same K/V shape on every attention layer; "
                f"{type(self.model).__name__} reported {sorted(set(probe.shapes))[:3]}"
            )
        (_, kv_heads, _, head_dim), (_, _, _, v_head_dim) = probe.shapes[0]
        return KVCache(len(probe.shapes), budget, kv_heads, head_dim, self.dtype, self.device, v_head_dim=v_head_dim)

    @torch.inference_mode()
    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a validated full set into the model's parameters in place."""
        for name, target in self._targets.items():
            target.copy_(tensors[name])

    def begin_weight_write(self) -> None:
        """Nothing to allocate before a write here (the lean runner may have given its matmul weights back)."""

    def weights_changed(self) -> None:
        """Nothing is derived from the parameters here (the lean runner refreshes its oneDNN copies)."""

    def copy_block(self, src: int, dst: int, n: int) -> None:
        """K/V of the first ``n`` positions of block ``src`` into block ``dst`` (a partial prefix block's copy)."""
        self.cache.copy_block(src, dst, n)

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

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        """One forward per item (its new tokens, attending to its blocks' cached prefix); last logits [n, V]."""
        out, bs = [], self.cache.block_size
        for it in items:
            n, p = len(it.token_ids), it.start_pos
            pos = torch.arange(p, p + n, device=self.device)
            cache = self._block_cache(self.cache)
            cache.rows = self.cache.flat_rows(it.kv_slots(bs).to(self.device))
            cache.tables = torch.tensor([it.block_table[: -(-(p + n) // bs)]], device=self.device)
            ids = torch.tensor([it.token_ids], device=self.device)
            mask = self._mask(pos[None], cache.get_seq_length())
            out.append(self._forward(ids, pos[None], cache, mask)[0])
        return torch.stack(out)

    @torch.inference_mode()
    def decode(
        self, block_tables: list[list[int]], tokens: list[int], positions: list[int], shared_prefixes=()
    ) -> torch.Tensor:
        """One batched forward: token ``i`` at ``positions[i]`` in the blocks of ``block_tables[i]``; logits [B, V]
        (``shared_prefixes``: unused)."""
        bs = self.cache.block_size
        pos = torch.tensor(positions, device=self.device)
        tables = torch.tensor(
            padded_tables(block_tables, max(len(t) for t in block_tables), self.cache.null_block), device=self.device
        )
        cache = self._block_cache(self.cache)
        cache.rows = self.cache.flat_rows(tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs)
        cache.tables = tables
        ids = torch.tensor(tokens, device=self.device)[:, None]
        return self._forward(ids, pos[:, None], cache, self._mask(pos[:, None], cache.get_seq_length()))
