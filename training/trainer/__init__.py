"""The policy trainer: model loading, sequence packing, chunked logprobs, optimizer steps.

Under ``torchrun`` the same classes shard themselves with FSDP2 (see ``distributed.py``).
"""

from training.trainer.logprobs import packed_logprobs, score_sequences
from training.trainer.model import load_causal_lm
from training.trainer.packing import PackedBatch, pack_sequences
from training.trainer.trainer import PolicyTrainer, ReferenceModel, combine_metrics
from training.utils.device import resolve_device, resolve_dtype

__all__ = [
    "PackedBatch",
    "PolicyTrainer",
    "ReferenceModel",
    "combine_metrics",
    "load_causal_lm",
    "pack_sequences",
    "packed_logprobs",
    "resolve_device",
    "resolve_dtype",
    "score_sequences",
]
