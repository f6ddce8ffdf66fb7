"""Per-token logprobs of given tokens, chunked so full-vocabulary logits never exist for a whole batch.

Alignment (the same as ``RolloutSample.logprobs``): for a sequence of length T,
``logprobs_T[t] = log p(tokens[t] | tokens[:t])`` for ``t >= 1`` and ``logprobs_T[0] = 0.0``.
With a sampling temperature τ the distribution is ``softmax(logits / τ)``, the one the sampler
drew from.

How: the decoder (``model.get_decoder()``) turns the packed micro-batch into hidden states
``[N, hidden]``; the LM head (``model.get_output_embeddings()``) projects ``chunk_tokens`` positions
at a time, ``log_softmax`` runs in fp32 on that chunk only and the target token's value is
kept. A plain ``nn.Linear`` head (every ``transformers`` causal LM's) runs as one autograd
function per chunk (``lm_head_logprobs.py``): nothing of size ``[chunk, V]`` is kept for
backward, which recomputes the chunk's logits and softmax once and returns the gradients of the
hidden states and the head's weight (a tied weight included). Any other head runs its own
forward under ``torch.utils.checkpoint``, its logits recomputed in backward. Either way peak
extra memory is one chunk's logits, not ``N × V``. Under autocast the head's matmuls run in the
autocast dtype and the log-softmax in fp32.

Shared prefixes (``packed.shared``, see ``prefix_sharing.py``): the decoder runs on the compute
row, the LM head on one (predictor row, target token) pair per predicted token, and
``source_N`` spreads the pairs' logprobs back over the ordinary ``[N]`` layout.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch.utils.checkpoint import checkpoint

from training.trainer.lm_head_logprobs import compute_weight, fusable_head, target_logprobs, target_logprobs_nograd
from training.trainer.model import PACKED_SDPA, attention_implementation
from training.trainer.packing import PackedBatch, pack_sequences


def _packing_arguments(model: torch.nn.Module, packed: PackedBatch) -> dict:
    """Decoder arguments that keep the sequences of ``packed`` apart, for the model's attention.

    One sequence needs nothing (plain causal attention). ``packed_sdpa`` and flash-attention
    take the sequence boundaries ``cu_seq_lens_q/k`` (and get no mask: ``transformers`` builds
    the one the fallback paths need from ``position_ids`` restarting at 0). ``sdpa`` takes a
    boolean block-diagonal 4-D mask, ``eager`` an additive float one (``transformers`` passes
    a 4-D mask through unchanged). Other implementations get ``position_ids`` only.
    """
    if packed.num_sequences == 1:
        return {"attention_mask": None}
    impl = attention_implementation(model)
    if impl == "sdpa":
        return {"attention_mask": packed.attention_mask(torch.bool)}
    if impl == "eager":
        return {"attention_mask": packed.attention_mask(next(model.parameters()).dtype)}
    if impl == PACKED_SDPA or impl.startswith("flash"):
        lengths = torch.tensor(packed.lengths, dtype=torch.int32)
        cu_seq_lens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        cu_seq_lens = cu_seq_lens.to(packed.input_ids_N.device)
        longest = max(packed.lengths)
        lengths_arg = {"packed_lengths": tuple(packed.lengths)} if impl == PACKED_SDPA else {}
        return {
            **lengths_arg,
            "attention_mask": None,
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": longest,
            "max_length_k": longest,
        }
    return {"attention_mask": None}


def packed_hidden_states(model: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    """Final hidden states of the decoder for one packed micro-batch (on the model's device):
    ``[N, hidden]``, or ``[C, hidden]`` over the compute row of a shared layout."""
    decoder = model.get_decoder()
    layout = packed.shared
    if layout is not None:
        layout.attention_calls = 0
        out = decoder(
            input_ids=layout.input_ids_C[None],
            position_ids=layout.position_ids_C[None],
            use_cache=False,
            attention_mask=None,
            shared_prefix_layout=layout,
        )
        layers = getattr(model.config, "num_hidden_layers", 1)
        if layout.attention_calls < layers:
            raise RuntimeError(
                f"shared_prefix_layout: {layout.attention_calls} of {layers} attention layers read it; "
                "this model cannot run shared-prompt packing (set shared_prompt_packing=False)"
            )
        return out.last_hidden_state[0]
    out = decoder(
        input_ids=packed.input_ids_N[None],
        position_ids=packed.position_ids_N[None],
        use_cache=False,
        **_packing_arguments(model, packed),
    )
    return out.last_hidden_state[0]


def _target_logprobs(
    hidden_M: torch.Tensor,
    targets_M: torch.Tensor,
    lm_head: torch.nn.Module,
    temperature: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """``log softmax(lm_head(h) / τ)[target]`` per row, computed in fp32 (a head that is not a plain linear layer)."""
    logits_MV = lm_head(hidden_M).float()
    if softcap:
        logits_MV = torch.tanh(logits_MV / softcap) * softcap
    if temperature != 1.0:
        logits_MV = logits_MV / temperature
    return logits_MV.gather(-1, targets_M[:, None]).squeeze(-1) - torch.logsumexp(logits_MV, dim=-1)


def chunked_token_logprobs(
    model: torch.nn.Module, hidden_N: torch.Tensor, packed: PackedBatch, chunk_tokens: int, temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs ``[N]`` (fp32) of ``packed.input_ids_N`` from the hidden states, aligned as in the module docstring
    (``hidden_N`` is ``[C, hidden]`` over the compute row when ``packed.shared`` is set).

    Differentiable when gradients are enabled (see the module docstring); the first token of each
    sequence is the constant 0.0.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens: must be > 0, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    lm_head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    layout = packed.shared
    if layout is None:  # hidden state at position i predicts the token at i + 1
        predictors_M, targets_M = hidden_N[:-1], packed.input_ids_N[1:]
    else:  # one row per (predictor, target) pair of the compute row
        predictors_M, targets_M = hidden_N.index_select(0, layout.predictor_M), layout.target_M
    m = predictors_M.shape[0]
    with_grad = torch.is_grad_enabled() and (
        hidden_N.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    fused = fusable_head(lm_head)
    weight_c = compute_weight(lm_head.weight) if fused else None
    pieces: list[torch.Tensor] = []
    for start in range(0, m, chunk_tokens):
        h_M = predictors_M[start : start + chunk_tokens]
        t_M = targets_M[start : start + chunk_tokens]
        if fused:
            score = target_logprobs if with_grad else target_logprobs_nograd
            pieces.append(score(h_M, t_M, lm_head, weight_c, temperature, softcap))
        elif with_grad:
            pieces.append(checkpoint(_target_logprobs, h_M, t_M, lm_head, temperature, softcap, use_reentrant=False))
        else:
            pieces.append(_target_logprobs(h_M, t_M, lm_head, temperature, softcap))
    first = torch.zeros(1, dtype=torch.float32, device=hidden_N.device)
    logprobs_N = torch.cat([first, *pieces])
    if layout is not None:
        return logprobs_N.index_select(0, layout.source_N)
    return torch.where(packed.is_sequence_start_N(), torch.zeros_like(logprobs_N), logprobs_N)


def packed_logprobs(
    model: torch.nn.Module, packed: PackedBatch, chunk_tokens: int, temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs ``[N]`` of one packed micro-batch: decoder forward, then chunked LM head."""
    return chunked_token_logprobs(model, packed_hidden_states(model, packed), packed, chunk_tokens, temperature)


@torch.no_grad()
def score_sequences(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    device: Union[str, torch.device],
    micro_batch_tokens: int,
    chunk_tokens: int,
    temperature: float = 1.0,
    share_prefixes: bool = False,
) -> list[list[float]]:
    """Logprobs of every token of every sequence (no gradient), packed into micro-batches
    (``share_prefixes``: shared-prompt packing, see ``prefix_sharing.py``).

    Returns one list per input sequence, in input order, aligned as in the module docstring.
    The caller puts the model in eval mode.
    """
    result: list[list[float]] = [[] for _ in sequences]
    for packed in pack_sequences(sequences, micro_batch_tokens, share_prefixes):
        logprobs_N = packed_logprobs(model, packed.to(device), chunk_tokens, temperature).cpu()
        for sample_index, logprobs_T in zip(packed.sample_indices, packed.split(logprobs_N)):
            result[sample_index] = logprobs_T.tolist()
    return result
