"""Fallback runner: the plain transformers forward, for architectures the lean forward lacks.

Same interface as :class:`~training.deployment.engine.model_runner.LeanModelRunner`
(``prefill``, ``decode``, ``load_weights``, ``release``, ``weight_shapes``, ``tied``,
``vocab_size``). Each slot keeps a transformers ``DynamicCache``; decode runs row by row (one
forward per sequence), so it is correct everywhere and slow: use the lean forward when you can.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from training.deployment.engine.model_runner import PrefillItem
from training.deployment.engine.weights import checkpoint_shapes


class HFModelRunner:
    """transformers ``AutoModelForCausalLM`` with one ``DynamicCache`` per KV slot."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.device = device
        self.vocab_size = self.model.config.vocab_size
        params = dict(self.model.named_parameters())
        if Path(path).exists():
            self.weight_shapes = checkpoint_shapes(path)
        else:  # hub id: the parameters' own names
            self.weight_shapes = {n: tuple(p.shape) for n, p in params.items()}
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False)) and \
            "lm_head.weight" not in self.weight_shapes
        state = self.model.state_dict()
        unknown = sorted(set(self.weight_shapes) - set(state))
        if unknown:
            raise ValueError(f"checkpoint tensor {unknown[0]} is not in the transformers model")
        self._targets = {n: state[n] for n in self.weight_shapes}
        self._caches: dict[int, object] = {}

    @property
    def targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint name → the parameter tensor a new value is copied into (in place)."""
        return self._targets

    @torch.inference_mode()
    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a validated full set into the model's parameters in place (running caches are kept)."""
        for name, target in self._targets.items():
            target.copy_(tensors[name])

    def _forward(self, slot: int, token_ids: list[int], start_pos: int) -> torch.Tensor:
        from transformers import DynamicCache

        cache = self._caches.get(slot)
        if cache is None or start_pos == 0:
            if start_pos != 0:
                raise RuntimeError(f"slot {slot} has no cache to continue at position {start_pos}")
            cache = DynamicCache(config=self.model.config)
            self._caches[slot] = cache
        elif cache.get_seq_length() > start_pos:
            cache.crop(start_pos)
        ids = torch.tensor([token_ids], device=self.device)
        pos = torch.arange(start_pos, start_pos + len(token_ids), device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        return torch.stack([self._forward(it.slot, it.token_ids, it.start_pos) for it in items])

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        return torch.stack([self._forward(s, [t], p) for s, t, p in zip(slots, tokens, positions)])

    def release(self, slot: int) -> None:
        """Slots are reused by position: a new sequence at position 0 replaces the cache."""
