"""The critic of PPO with GAE: a scalar value head on the policy's final hidden states, with its own AdamW.

``ValueHead`` is ``Linear(hidden, 1)`` in float32, initialised to zero (V = 0 everywhere at step 0, so the first
advantages are the returns themselves). It runs on the hidden states of the same packed forward that computes the
logprobs (``capture_hidden_states``: a hook on the decoder's output), so it needs no second model, no extra process
and no extra forward in ``forward_backward``; the hidden states are detached first, so the value loss trains the
head alone. Alignment is that of the logprobs (``logprobs.py``): ``values_N[t] = head(h[t - 1])``, the value of the
state that predicts token t, and 0.0 on the first token of each sequence; with a shared-prefix layout the same
predictor rows are read (``packed.shared.predictor_M`` spread back by ``source_N``).

Its parameters and optimizer state are checkpointed beside the policy's (``checkpoint.save_checkpoint(critic=)``)
and are not part of the exported or synced weights. One process only (not under ``torchrun`` yet).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch

from training.trainer.packing import PackedBatch
from training.utils.rl.critic_config import CriticConfig


class ValueHead:
    """``Linear(hidden_size, 1)`` (float32, zero init) on ``device`` and its AdamW (constant ``cfg.learning_rate``)."""

    def __init__(
        self,
        hidden_size: int,
        cfg: CriticConfig,
        device: torch.device,
        betas: tuple[float, float] = (0.9, 0.95),
        grad_clip_norm: float = 1.0,
    ):
        self.cfg = cfg
        self.grad_clip_norm = grad_clip_norm
        self.head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32, device=device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.learning_rate, betas=betas, weight_decay=0.0)

    def values_N(self, hidden_N: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
        """V per token ``[N]`` (float32) of one packed micro-batch from its final hidden states (``[N, hidden]``, or
        ``[C, hidden]`` over a shared layout's compute row), aligned as in the module docstring. Differentiable in the
        head's parameters only."""
        hidden = hidden_N.detach().float()
        layout = packed.shared
        predictors_M = hidden[:-1] if layout is None else hidden.index_select(0, layout.predictor_M)
        first = torch.zeros(1, dtype=torch.float32, device=hidden.device)
        values_N = torch.cat([first, self.head(predictors_M).squeeze(-1)])
        if layout is not None:
            return values_N.index_select(0, layout.source_N)
        return torch.where(packed.is_sequence_start_N(), torch.zeros_like(values_N), values_N)

    def step(self) -> float:
        """Clip the head's gradient norm to ``grad_clip_norm`` (0 = none), AdamW step, zero grads; the norm before
        clipping (a non-finite one skips the update)."""
        params = [p for p in self.head.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.grad_clip_norm if self.grad_clip_norm > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def num_bytes(self) -> int:
        """Parameters, gradients and the two AdamW moments, in bytes (what the memory plan adds)."""
        return 4 * sum(p.numel() for p in self.head.parameters()) * 4


@contextlib.contextmanager
def capture_hidden_states(model: torch.nn.Module) -> Iterator[list[Optional[torch.Tensor]]]:
    """Within the block, ``box[0]`` holds the last final hidden states the decoder (``model.get_decoder()``)
    returned, ``[N, hidden]`` (batch row 0 of its ``last_hidden_state``)."""
    box: list[Optional[torch.Tensor]] = [None]

    def keep(module, args, output) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None:
            hidden = output[0] if isinstance(output, tuple) else output
        box[0] = hidden[0]

    handle = model.get_decoder().register_forward_hook(keep)
    try:
        yield box
    finally:
        handle.remove()
