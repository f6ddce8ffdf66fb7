"""LM head + log-softmax of given target tokens, one autograd function per chunk of rows.

For hidden states ``h_M`` (``[M, hidden]``), the LM head ``W`` (``[V, hidden]``, bias ``b``
optional), target ids ``t_M``, temperature τ and an optional final-logit softcap ``c``::

    x = h Wᵀ + b                      raw logits, [M, V]
    z = c·tanh(x / c)  (or z = x)     softcap
    s = z / τ
    logprob_m = s[m, t_m] − logsumexp(s[m])

computed in fp32 whatever the compute dtype. Gradient of ``logprob_m`` with upstream ``g_m``::

    ∂s[m, v] = g_m · (1[v = t_m] − softmax(s[m])[v])
    ∂x       = ∂s / τ · (1 − (z / c)²)   (the last factor only with a softcap)
    ∂h = ∂x W,    ∂W = ∂xᵀ h,    ∂b = Σ_m ∂x[m]

What is kept for backward: the chunk's inputs (``h``, the targets, references to ``W``), no
``[M, V]`` buffer. The backward recomputes the chunk's logits once (one LM head matmul), their
softmax once, then the two gradient matmuls: four LM head matmuls per chunk in all, as with
``torch.utils.checkpoint``, but none of the ``log_softmax`` / ``logsumexp`` / ``gather``
autograd nodes, their ``[M, V]`` intermediates and their backward passes. With a frozen head
(LoRA: ``W`` needs no gradient) the forward instead computes ``∂logprob/∂h`` for unit ``g``
(``[M, hidden]``, one extra matmul) and the backward only scales it: two LM head matmuls per
chunk instead of three, and no recompute.

Tied embeddings need nothing special: the gradient is returned for the ``W`` passed in, the
shared ``Parameter``, and autograd adds it to the embedding lookup's. Under autocast the
matmuls run in the autocast dtype (``W`` cast once per call by the caller), logits are
upcast to fp32 before the softcap, the temperature and the softmax.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _logits_fp32(
    hidden_M: torch.Tensor,
    weight_c: torch.Tensor,
    bias: Optional[torch.Tensor],
    temperature: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """``s`` of the module docstring, ``[M, V]`` fp32, a fresh buffer (safe to modify in place)."""
    x = F.linear(hidden_M.to(weight_c.dtype), weight_c, None if bias is None else bias.to(weight_c.dtype))
    s = x.float() if x.dtype != torch.float32 else x
    if softcap:
        s = s.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        s = s.div_(temperature)
    return s


def _target_values(s_MV: torch.Tensor, targets_M: torch.Tensor) -> torch.Tensor:
    """``s[m, t_m] − logsumexp(s[m])`` per row (fp32)."""
    return torch.log_softmax(s_MV, dim=-1).gather(-1, targets_M[:, None]).squeeze(-1)


def _grad_logits(
    s_MV: torch.Tensor, targets_M: torch.Tensor, grad_M: torch.Tensor, temperature: float, softcap: Optional[float]
) -> torch.Tensor:
    """``∂x`` of the module docstring from ``s`` (consumed: it may be overwritten), fp32 ``[M, V]``."""
    scale_M = grad_M.float() / temperature
    factor = None
    if softcap:  # 1 − (z/c)² with z = τ·s
        factor = (s_MV * (temperature / softcap)).square_().neg_().add_(1.0)
    grad_MV = torch.softmax(s_MV, dim=-1).mul_(-scale_M[:, None])
    grad_MV.scatter_add_(-1, targets_M[:, None], scale_M[:, None])
    if factor is not None:
        grad_MV.mul_(factor)
    return grad_MV


class TargetLogprobs(torch.autograd.Function):
    """One chunk: ``logprob_M`` of the targets (fp32), differentiable w.r.t. ``hidden_M``, ``weight`` and ``bias``.

    Arguments: ``hidden_M``, ``weight`` (the LM head's parameter, where its gradient goes),
    ``bias`` (or None), ``weight_c`` (``weight`` in the compute dtype: ``weight`` itself in fp32;
    no gradient flows through it), ``targets_M``, ``temperature``, ``softcap`` (None or 0: off).
    """

    @staticmethod
    def forward(ctx, hidden_M, weight, bias, weight_c, targets_M, temperature, softcap):
        s_MV = _logits_fp32(hidden_M, weight_c, bias, temperature, softcap)
        logprobs_M = _target_values(s_MV, targets_M)
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
        ctx.temperature, ctx.softcap = temperature, softcap
        ctx.hidden_dtype = hidden_M.dtype
        if needs_h and not (needs_w or needs_b):  # frozen head: ∂logprob/∂h for g = 1 now, no recompute later
            grad_MV = _grad_logits(s_MV, targets_M, torch.ones_like(logprobs_M), temperature, softcap)
            del s_MV
            ctx.save_for_backward(grad_MV.to(weight_c.dtype) @ weight_c)
            ctx.frozen_head = True
            return logprobs_M
        del s_MV
        ctx.frozen_head = False
        ctx.save_for_backward(hidden_M, weight, bias, weight_c, targets_M)
        return logprobs_M

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_M):
        if ctx.frozen_head:
            (unit_grad_MH,) = ctx.saved_tensors
            grad_h = (unit_grad_MH * grad_M[:, None].to(unit_grad_MH.dtype)).to(ctx.hidden_dtype)
            return grad_h, None, None, None, None, None, None
        hidden_M, weight, bias, weight_c, targets_M = ctx.saved_tensors
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
        with torch.autocast(device_type=hidden_M.device.type, enabled=False):
            s_MV = _logits_fp32(hidden_M, weight_c, bias, ctx.temperature, ctx.softcap)
            grad_MV = _grad_logits(s_MV, targets_M, grad_M, ctx.temperature, ctx.softcap)
            del s_MV
            grad_b = grad_MV.sum(0).to(bias.dtype) if needs_b else None
            grad_c = grad_MV.to(weight_c.dtype) if weight_c.dtype != torch.float32 else grad_MV
            del grad_MV
            grad_h = (grad_c @ weight_c).to(hidden_M.dtype) if needs_h else None
            grad_w = (grad_c.t() @ hidden_M.to(weight_c.dtype)).to(weight.dtype) if needs_w else None
        return grad_h, grad_w, grad_b, None, None, None, None


def fusable_head(lm_head: torch.nn.Module) -> bool:
    """Whether ``lm_head`` is a plain ``nn.Linear`` (its forward is ``F.linear(h, weight, bias)``), which
    ``TargetLogprobs`` computes itself; anything else (an adapter-wrapped head, a custom module) is run as is."""
    return isinstance(lm_head, torch.nn.Linear) and type(lm_head).forward is torch.nn.Linear.forward


def compute_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in the autocast dtype of its device when autocast is on there, else ``weight`` itself
    (cast once per micro-batch, shared by its chunks; no gradient flows through the copy)."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype != weight.dtype:
            return weight.detach().to(dtype)
    return weight


def target_logprobs_nograd(
    hidden_M: torch.Tensor,
    targets_M: torch.Tensor,
    lm_head: torch.nn.Linear,
    weight_c: torch.Tensor,
    temperature: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """The forward of ``TargetLogprobs`` without autograd (scoring): the same values, bit for bit."""
    with torch.no_grad(), torch.autocast(device_type=hidden_M.device.type, enabled=False):
        return _target_values(_logits_fp32(hidden_M, weight_c, lm_head.bias, temperature, softcap), targets_M)


def target_logprobs(
    hidden_M: torch.Tensor,
    targets_M: torch.Tensor,
    lm_head: torch.nn.Linear,
    weight_c: torch.Tensor,
    temperature: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """``TargetLogprobs`` of one chunk (with gradient), autocast switched off inside (dtypes are explicit)."""
    with torch.autocast(device_type=hidden_M.device.type, enabled=False):
        return TargetLogprobs.apply(
            hidden_M, lm_head.weight, lm_head.bias, weight_c, targets_M, temperature, softcap or None
        )
