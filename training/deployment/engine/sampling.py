"""Batched sampling with per-request generators, and the logprob the engine reports.

For a row with temperature T > 0 and top-p P:
    logp = log_softmax(logits / T)                  (full vocabulary, BEFORE top-p truncation)
    keep the smallest set of most likely tokens whose mass reaches P, renormalise, sample
    reported logprob = logp[sampled token]
At T = 0 the token is argmax(logits) and the reported logprob is log_softmax(logits)[token]
(the raw T = 1 distribution). The trainer must compute its logprobs with the same temperature
(``logits / T``) for the importance ratios against these sampler logprobs to be meaningful.

Randomness: each request owns a CPU ``torch.Generator``; a row draws exactly one uniform u from
it per step and picks the token by inverse CDF (first index whose cumulative mass exceeds
u · kept mass). A seeded request therefore samples the same tokens whatever else is batched
with it. One batched pass over the vocabulary per step; no per-row device syncs.
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def sample(logits_B_V: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator]) -> tuple[list[int], list[float]]:
    """Sample one token per row; return (token ids, logprobs) as Python lists (one host sync)."""
    device = logits_B_V.device
    logits = logits_B_V.float()
    if all(t == 0 for t in temperatures):
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        temp_B = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=device)
        logp = torch.log_softmax(logits / temp_B[:, None], dim=-1)
        probs = logp.exp()
        u_B = torch.cat([torch.rand(1, generator=g) for g in generators]).to(device)
        if any(p < 1.0 for p in top_ps):
            top_p_B = torch.tensor(top_ps, device=device)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(dim=-1)
            keep = (cum - sorted_p) < top_p_B[:, None]   # the top token is always kept
            cum = (sorted_p * keep).cumsum(dim=-1)
            idx = torch.searchsorted(cum, (u_B * cum[:, -1])[:, None], right=True)
            idx = idx.clamp(max=keep.sum(-1, keepdim=True) - 1)
            sampled = order.gather(1, idx).squeeze(1)
        else:
            cum = probs.cumsum(dim=-1)
            idx = torch.searchsorted(cum, (u_B * cum[:, -1])[:, None], right=True)
            sampled = idx.clamp(max=probs.shape[-1] - 1).squeeze(1)
            # a zero-probability token can only be hit through rounding at the top end
            sampled = torch.where(probs.gather(1, sampled[:, None]).squeeze(1) > 0, sampled,
                                  probs.argmax(dim=-1))
        greedy_B = torch.tensor([t == 0 for t in temperatures], device=device)
        tokens = torch.where(greedy_B, logits.argmax(dim=-1), sampled)
    lps = logp.gather(1, tokens[:, None]).squeeze(1)
    both = torch.stack([tokens.to(torch.float64), lps.to(torch.float64)]).cpu()
    return [int(t) for t in both[0].tolist()], both[1].tolist()
