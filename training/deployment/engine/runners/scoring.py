"""Prompt logprobs: a scoring forward over given token sequences, apart from generation.

``score_prompts(runner, prompts, top_k, temperature)`` returns, for every token of every prompt, its logprob
given the tokens before it (teacher forcing), its rank in the vocabulary and optionally the
``top_k`` most likely tokens: what vLLM's ``prompt_logprobs`` returns, and what on-policy
distillation asks a teacher for (the teacher's logprob of each token the student sampled).

Invariants:
- It never reads or writes the engine's KV cache: every layer attends over the prompt's own
  keys and values, computed in this forward and dropped after it (a causal forward, like a
  prefill from position 0 into a throw-away cache). Scheduling, blocks and cached prefixes are
  untouched, so it can run on the engine thread between any two steps.
- The logprob is ``log_softmax(logits / temperature)``: raw logits at ``temperature`` 1 (the default, and
  what vLLM's prompt logprobs are, whatever ``--logprobs-mode`` says); no penalty, no bias. Another
  temperature scores the distribution a sampler at that temperature (top-p 1) draws from, which is what a
  distillation teacher must be compared at (``training/recipes/teacher.py``). Position 0 has none.
- The lean runner scores with ``LeanModelRunner.hidden_states`` (its prefill's forward without the
  cache: the same weights, fused matmuls, RoPE tables and norms) and ``logits``, so the figures match
  a ``transformers`` forward as closely as its prefill does (fp32: ~1e-5); the fallback runner calls
  the ``transformers`` model itself.
- Logits are formed ``SCORE_CHUNK_TOKENS`` rows at a time and reduced at once, so a long prompt
  never holds ``[T, vocab]`` fp32 logits whole (the fallback runner excepted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

SCORE_CHUNK_TOKENS = 256
"""Positions whose logits are formed and reduced together (the lean runner)."""


@dataclass
class PromptLogprobs:
    """The scoring of one token sequence: one entry per token, None at position 0 (nothing precedes it)."""

    token_ids: list[int]
    logprobs: list[Optional[float]]
    """``log p(token_ids[t] | token_ids[:t])``, raw logits (no temperature); None at t = 0."""
    ranks: list[Optional[int]]
    """1-based rank of ``token_ids[t]`` among all tokens at position t (1 = the likeliest); None at t = 0."""
    top_logprobs: Optional[list[Optional[list[tuple[int, float]]]]]
    """With ``top_k > 0``: per position the ``top_k`` likeliest (token id, logprob), best first; None at t = 0."""
    weight_version: int = 0
    """The weight version that scored it (set by the engine)."""


def _reduce(
    logits_MV: torch.Tensor, targets_M: torch.Tensor, top_k: int, temperature: float = 1.0
) -> tuple[list[float], list[int], Optional[list[list[tuple[int, float]]]]]:
    """Logprob and rank of each target, and the ``top_k`` alternatives, from fp32 logits ``[M, V]`` / temperature."""
    logits_MV = logits_MV.float()
    if temperature != 1.0:
        logits_MV = logits_MV / temperature
    lse_M = torch.logsumexp(logits_MV, dim=-1)
    target_logit_M = logits_MV.gather(1, targets_M[:, None])[:, 0]
    logprobs = (target_logit_M - lse_M).tolist()
    ranks = ((logits_MV > target_logit_M[:, None]).sum(dim=-1) + 1).tolist()
    top = None
    if top_k > 0:
        values_MK, ids_MK = torch.topk(logits_MV, top_k, dim=-1)
        values_MK = values_MK - lse_M[:, None]
        top = [list(zip(i, v)) for i, v in zip(ids_MK.tolist(), values_MK.tolist())]
    return logprobs, ranks, top


def _score_lean(runner, prompts: list[list[int]], top_k: int, temperature: float) -> list[tuple]:
    inputs = [p[:-1] for p in prompts]  # the last token predicts nothing that is asked for
    x = runner.hidden_states(inputs)
    targets_N = torch.tensor([t for p in prompts for t in p[1:]], device=runner.device)
    logprobs: list[float] = []
    ranks: list[int] = []
    top: Optional[list] = [] if top_k > 0 else None
    for a in range(0, x.shape[0], SCORE_CHUNK_TOKENS):
        lp, rk, tp = _reduce(
            runner.logits(x[a : a + SCORE_CHUNK_TOKENS]), targets_N[a : a + SCORE_CHUNK_TOKENS], top_k, temperature
        )
        logprobs += lp
        ranks += rk
        if top is not None:
            top += tp
    out, start = [], 0
    for p in prompts:
        end = start + len(p) - 1
        out.append((logprobs[start:end], ranks[start:end], None if top is None else top[start:end]))
        start = end
    return out


def _score_hf(runner, prompts: list[list[int]], top_k: int, temperature: float) -> list[tuple]:
    out = []
    for p in prompts:
        ids = torch.tensor([p[:-1]], device=runner.device)
        logits = runner.model(input_ids=ids, use_cache=False).logits[0]
        out.append(_reduce(logits, torch.tensor(p[1:], device=runner.device), top_k, temperature))
    return out


@torch.inference_mode()
def score_prompts(runner, prompts: list[list[int]], top_k: int = 0, temperature: float = 1.0) -> list[PromptLogprobs]:
    """Teacher-forced logprobs of every token of every prompt (module docstring); nothing cached is touched.
    ``temperature`` (> 0) divides the logits first (1: raw).

    ``runner``: the engine's ``LeanModelRunner`` or ``HFModelRunner``. Prompts must be non-empty and at
    most the runner's ``max_len`` tokens (the engine validates them first)."""
    from training.deployment.engine.runners.hf import HFModelRunner

    scorable = [p for p in prompts if len(p) > 1]
    if not scorable:
        parts = []
    elif isinstance(runner, HFModelRunner):
        parts = _score_hf(runner, scorable, top_k, temperature)
    else:
        parts = _score_lean(runner, scorable, top_k, temperature)
    parts_iter = iter(parts)
    result = []
    for p in prompts:
        lp, rk, tp = next(parts_iter) if len(p) > 1 else ([], [], [])
        result.append(
            PromptLogprobs(
                token_ids=list(p),
                logprobs=[None, *lp],
                ranks=[None, *rk],
                top_logprobs=[None, *tp] if top_k > 0 else None,
            )
        )
    return result


class ScorePrompts:
    """One ``prompt_logprobs`` call for the engine thread (its inbox, inbox.py, runs it between two steps, never while
    paused or asleep); skipped if its caller went away first (``cancelled``)."""

    def __init__(self, prompts: list[list[int]], top_k: int, done: Callable, temperature: float = 1.0):
        self.prompts, self.top_k, self.done, self.temperature = prompts, top_k, done, temperature
        self.cancelled = False

    def run(self, engine) -> None:
        """Engine thread (``engine``: the ``LLMEngine``): score the prompts under the live weights; ``done(scored)`` (each stamped with the weight
        version) or ``done(exc)``, a failure being this caller's alone. Counted in ``engine.counters``."""
        if self.cancelled:
            return
        try:
            scored = score_prompts(engine.runner, self.prompts, self.top_k, self.temperature)
            for s in scored:
                s.weight_version = engine.weight_version
            engine.counters["prompt_logprobs_requests"] += 1
            engine.counters["prompt_logprobs_tokens"] += sum(len(p) for p in self.prompts)
            self.done(scored)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            log.exception("prompt logprobs failed")
            self.done(exc)
