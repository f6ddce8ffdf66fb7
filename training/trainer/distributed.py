"""FSDP2 for the trainer under ``torchrun``: sharding, sharded logprobs, and splitting a batch over ranks.

The process group and the rank-0 command protocol are the ground floor
(``training/utils/dist.py``); this module adds what only the trainer needs:

- ``shard_model`` applies ``fully_shard`` to every decoder layer, then to the whole model;
  each parameter becomes a ``DTensor`` holding 1/world of it.
- Data parallelism inside a call: each rank takes a token-balanced share of the sequences
  (``split_for_ranks``; with shared-prompt packing, of the units: a group sharing a prompt
  stays on one rank) and pads its list of micro-batches to the longest rank's count with
  throw-away micro-batches (``plan_micro_batches``), because every forward and backward
  of a sharded model is a collective that all ranks must run.
"""

from __future__ import annotations

import types
from typing import Optional, Sequence

import torch

from training.trainer.model import decoder_layers
from training.trainer.packing import PackedBatch, pack_sequences, pack_units, plan_units, unit_tokens
from training.utils.dist import is_distributed, max_over_ranks, rank, world_size

FSDP_LOGPROBS_METHOD = "fsdp_packed_logprobs"
"""Name of the model method registered with FSDP so that one call gathers the root parameters
(embeddings, final norm, LM head) around the decoder + chunked LM head (``packed_logprobs``)."""


# ---- FSDP2 ----------------------------------------------------------------------------------
def shard_model(
    model: torch.nn.Module, device: torch.device, compute_dtype: Optional[torch.dtype] = None
) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root; gradients are SUMMED over ranks.

    FSDP averages gradients over ranks by default; here the divide factor is 1, because each
    rank's loss is already its share of the step's loss (divided by step-wide denominators),
    so the sum over ranks is the single-process gradient. Registers ``FSDP_LOGPROBS_METHOD``
    so ``fsdp_logprobs(model, ...)`` gathers the root's parameters. Returns ``model`` (in place).

    Mixed precision: with ``compute_dtype`` lower than the parameters' dtype (bf16 compute over fp32
    master weights, the CUDA default) the all-gathers move ``compute_dtype`` parameters and the
    forward and backward run in it, while gradients are reduced in fp32 into the fp32 shards the
    optimizer keeps (``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from training.trainer.logprobs import packed_logprobs

    mesh = init_device_mesh(device.type, (world_size(),))
    param_dtype = next(model.parameters()).dtype
    policy = {}
    if compute_dtype is not None and compute_dtype.itemsize < param_dtype.itemsize:
        policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)}
    for layer in decoder_layers(model):  # the repeated blocks, sharded one by one
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    setattr(model, FSDP_LOGPROBS_METHOD, types.MethodType(packed_logprobs, model))
    register_fsdp_forward_method(model, FSDP_LOGPROBS_METHOD)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return hasattr(model, FSDP_LOGPROBS_METHOD)


def fsdp_logprobs(model: torch.nn.Module, packed: PackedBatch, chunk_tokens: int, temperature: float) -> torch.Tensor:
    """``packed_logprobs`` on a model that ``shard_model`` sharded (or a plain one)."""
    if is_sharded(model):
        return getattr(model, FSDP_LOGPROBS_METHOD)(packed, chunk_tokens, temperature)
    from training.trainer.logprobs import packed_logprobs

    return packed_logprobs(model, packed, chunk_tokens, temperature)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a ``DTensor`` (a collective: every rank must call it), else ``tensor``."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# ---- splitting work ---------------------------------------------------------------------------
def split_for_ranks(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of the items (sequences, or packing units) each rank takes, given their token
    counts: longest first, each to the rank with the fewest tokens so far (ties: lowest rank).
    Deterministic; each list is in increasing index order."""
    load = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def plan_micro_batches(
    sequences: Sequence[Sequence[int]], max_tokens: int, share_prefixes: bool = False
) -> list[tuple[PackedBatch, bool]]:
    """``(packed, is_real)`` micro-batches this rank runs for ``sequences``.

    Single process: ``pack_sequences(sequences, share_prefixes=...)``, all real. Under torchrun:
    this rank's share of the units (``plan_units``: sequences, or groups sharing a prefix, each
    kept whole; ``split_for_ranks`` by computed tokens) packed, with ``sample_indices`` pointing
    into ``sequences``, then padded with throw-away micro-batches (the shortest sequence;
    ``is_real=False``) up to the longest rank's count, so that every rank runs as many forwards
    and backwards.
    """
    if not is_distributed():
        return [(p, True) for p in pack_sequences(sequences, max_tokens, share_prefixes)]
    units = plan_units(sequences, max_tokens, share_prefixes)
    share = split_for_ranks([unit_tokens(sequences, u) for u in units], world_size())[rank()]
    planned = [(packed, True) for packed in pack_units(sequences, [units[k] for k in share], max_tokens)]
    count = max_over_ranks(len(planned))
    shortest = min(range(len(sequences)), key=lambda i: len(sequences[i]))
    filler = pack_units(sequences, [([shortest], 0)], max_tokens)[0]
    return planned + [(filler, False)] * (count - len(planned))
