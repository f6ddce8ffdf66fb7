"""Move an optimizer's state tensors between the GPU and host memory (``TrainerConfig.offload_optimizer``).

AdamW keeps two fp32 moments per parameter (8 bytes / parameter, half of full fine-tuning's 16): on one GPU
shared with the engine (``deployment.colocate``) they live in host memory while the engine generates and
come back for the optimizer step. On CPU there is nothing to move: a no-op.
"""

from __future__ import annotations

import torch


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Move every tensor of ``optimizer.state`` to ``device`` (pinned host memory when it is the CPU); the bytes
    moved. Scalar ``step`` counters stay where AdamW keeps them."""
    moved = 0
    pin = device.type == "cpu" and torch.cuda.is_available()
    for state in optimizer.state.values():
        for key, t in state.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.device == device:
                continue
            out = t.to(device, non_blocking=True)
            if pin:
                out = out.pin_memory()
            state[key] = out
            moved += t.nbytes
    if device.type == "cuda" or pin:
        torch.cuda.synchronize()
    return moved
