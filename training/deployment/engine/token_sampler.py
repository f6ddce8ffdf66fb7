"""Batched sampling with per-request generators, and the logprob the engine reports.

One pass over a batch of rows (one row per sequence), in vLLM's order:
    z = logits                                      (fp32, the model's raw logits)
    z[stop ids] = -inf        while the output is shorter than min_tokens
    z[t] += logit_bias[t]
    z[t] = z[t] / r if z[t] > 0 else z[t] * r       for t in prompt or output (repetition_penalty r)
    z[t] -= frequency_penalty * count_out(t) + presence_penalty * [count_out(t) > 0]
    q = softmax(z / T)                               (T > 0; T = 0 takes argmax(z))
    keep the top_k most likely, those with q >= min_p * max q, then the smallest prefix whose mass
    reaches top_p of what is left (the top token is always kept); draw from q renormalised on it.

Reported logprob (what the trainer's TIS compares against), for every row whatever the fields:
    logp = log_softmax(logits / T)                  (raw logits, full vocabulary; T = 1 when T = 0)
    reported = logp[sampled token];  top_logprobs = the k largest entries of logp
so penalties, logit_bias, min_tokens, top-k / top-p / min-p change which token is drawn, never the
reported value. T is fp32 (clamped to fp32's smallest normal); a row with T below
``SHIFT_BELOW_T`` is scaled as (z - max z) / T so it cannot overflow (the same maths), and a token
whose probability underflows reports a finite fp32 (the lowest at worst), never -inf.

Randomness: each request owns a CPU ``torch.Generator``; a row draws exactly one uniform u from
it per step (greedy rows included, when any row samples) and picks the token by inverse CDF
(first index whose cumulative kept mass exceeds u · kept mass; for rows without truncation the
mass is summed a block of ``DRAW_BLOCK`` tokens at a time). Every formula a row goes through
depends on its own fields only, so a seeded request samples the same tokens whatever else is
batched with it. The whole batch needs one host sync; penalties touch only the tokens a row has
seen (sparse), so their cost grows with the sequence length, not the vocabulary.

A row whose logits (raw, or after its own processing) leave nothing to sample (NaN, +inf, or
every token masked) is reported in ``SampleOutput.failed``; the engine ends that sequence alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import torch

from training.deployment.engine.runners.native import sample_plain
from training.deployment.engine.sequence import Sequence

SHIFT_BELOW_T = 1e-4
"""Rows with 0 < T below this are scaled as (z - max z) / T (no overflow); others as z / T, as the trainer."""
CANDIDATES = 256
"""Tokens sorted per row for top-k / top-p / min-p before falling back to the whole vocabulary (_sample_truncated)."""
DRAW_BLOCK = 256
"""Tokens per block of a plain row's inverse-CDF draw (_draw_blocked)."""
NATIVE_SAMPLER_FIELDS = frozenset(
    {"temperature", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output"}
)
"""The request fields a row may set (to anything but their default) and still go to the C sampler: the
temperature (it draws at it), the seed (the row's generator supplies u), and the fields the engine applies
outside sampling (stop conditions, the output text). Any other field set on a row, including one added to
``SamplingParams`` later and not listed here, sends the batch to the torch sampler (``_plain``), so the C
path can never silently ignore a field."""
_LOWEST = torch.finfo(torch.float32).min
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SampleOutput:
    """Per row of the batch: the sampled token, its reported logprob, alternatives, or why it failed."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[Optional[list[tuple[int, float]]]]
    """(token id, logprob) best first for rows with ``top_logprobs > 0``, else None."""
    failed: list[Optional[str]]
    """None, or why the row could not be sampled (its token and logprob are then meaningless)."""


@torch.inference_mode()
def sample(logits_BV: torch.Tensor, seqs: Seq[Sequence], native: bool = False) -> SampleOutput:
    """Sample one token for each sequence from its row of logits (one host sync for the batch).

    ``native``: a batch of plain rows on CPU (temperature >= SHIFT_BELOW_T and nothing else: the RL
    case) is drawn by the C sampler of native.py, the same draw and logprob in two reads of each row.
    """
    device = logits_BV.device
    logits = logits_BV.float()
    params = [s.params for s in seqs]
    if native and device.type == "cpu" and all(_plain(p) for p in params):
        return _sample_plain_native(logits, seqs)
    temps = [p.temperature for p in params]
    scale = _Scaler(temps, device)
    logp = torch.log_softmax(scale(logits), dim=-1)  # the reported distribution

    processed = any(p.needs_processing for p in params)
    z = _process(logits, seqs) if processed else logits
    greedy = [t == 0 for t in temps]
    truncates = [p.truncates and t > 0 for p, t in zip(params, temps)]
    plain = [not g and not tr for g, tr in zip(greedy, truncates)]
    greedy_tokens = z.argmax(dim=-1) if any(greedy) else None
    if all(greedy):
        tokens = greedy_tokens
    else:
        probs = (torch.log_softmax(scale(z), dim=-1) if processed else logp).exp()
        u_B = torch.cat([torch.rand(1, generator=s.generator) for s in seqs]).to(device)
        tokens = _draw_blocked(probs, u_B) if any(plain) else None
        if any(truncates):  # chosen per row, so a row's draw never depends on its neighbours' fields
            cut = _sample_truncated(probs, u_B, params)
            tokens = cut if tokens is None else torch.where(torch.tensor(truncates, device=device), cut, tokens)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=device), greedy_tokens, tokens)

    lps = logp.gather(1, tokens[:, None])
    ok = ~torch.isnan(lps)  # NaN / +inf logits make the whole log_softmax row NaN
    if processed:
        ok &= torch.isfinite(z.amax(dim=-1, keepdim=True))  # something was left to sample
    cols = [tokens[:, None].to(torch.float64), lps.to(torch.float64), ok.to(torch.float64)]
    k = min(max(p.top_logprobs for p in params), logp.shape[-1])
    if k > 0:
        top_v, top_i = logp.topk(k, dim=-1)
        cols += [top_i.to(torch.float64), top_v.to(torch.float64)]
    host = torch.cat(cols, dim=1).clamp(min=_LOWEST).cpu().tolist()  # the one host sync

    out = SampleOutput([], [], [], [])
    for row, p in zip(host, params):
        out.token_ids.append(int(row[0]))
        out.logprobs.append(row[1])
        out.failed.append(
            None if row[2] else "no finite logit to sample from (non-finite model output, or every token masked)"
        )
        if p.top_logprobs > 0:
            ids, vals = row[3 : 3 + k], row[3 + k : 3 + 2 * k]
            out.top_logprobs.append([(int(i), v) for i, v in zip(ids[: p.top_logprobs], vals[: p.top_logprobs])])
        else:
            out.top_logprobs.append(None)
    return out


def _plain(p) -> bool:
    """Temperature alone, in the range the C sampler takes as is: every field the row sets away from its
    default is in ``NATIVE_SAMPLER_FIELDS`` (no processing, truncation, alternatives or unknown field)."""
    if not SHIFT_BELOW_T <= p.temperature < float("inf"):
        return False
    defaults = _field_defaults(type(p))
    return all(getattr(p, name) == default for name, default in defaults.items())


@functools.cache
def _field_defaults(cls: type) -> dict[str, object]:
    """Default value of every dataclass field of ``cls`` that the C sampler does not handle (no default: a
    sentinel no value equals, so such a field always counts as set)."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.name in NATIVE_SAMPLER_FIELDS:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = object()
    return out


def _sample_plain_native(logits: torch.Tensor, seqs: Seq[Sequence]) -> SampleOutput:
    u_B = torch.cat([torch.rand(1, generator=s.generator) for s in seqs])
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
    tokens, logprobs, ok = sample_plain(logits, temps, u_B)
    failed = None if ok.all() else "no finite logit to sample from (non-finite model output, or every token masked)"
    return SampleOutput(
        tokens.tolist(),
        logprobs.clamp(min=_LOWEST).tolist(),
        [None] * len(seqs),
        [None if good else failed for good in ok.tolist()],
    )


class _Scaler:
    """``x / T`` per row (T = 1 for greedy rows), shifted by the row max where T < SHIFT_BELOW_T.

    Subtracting 0 and dividing by 1 are exact, so a row's values do not depend on whether its
    neighbours needed the shift or a division.
    """

    def __init__(self, temps: list[float], device: torch.device):
        self.t_B = torch.tensor([t if t > 0 else 1.0 for t in temps], device=device).clamp(min=_TINY)[:, None]
        self.divide = any(t not in (0.0, 1.0) for t in temps)
        tiny = [0 < t < SHIFT_BELOW_T for t in temps]
        self.shift_B = torch.tensor(tiny, device=device)[:, None] if any(tiny) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.shift_B is not None:
            x = x - torch.where(self.shift_B, x.amax(dim=-1, keepdim=True), 0.0)
        return x / self.t_B if self.divide else x


def _process(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """The sampling logits z: min_tokens mask, logit_bias, then the three penalties, sparse per row."""
    device = logits.device
    z = logits.clone()
    rows, cols, vals = [], [], []
    for i, s in enumerate(seqs):
        for t, b in s.params.logit_bias.items():
            rows.append(i)
            cols.append(t)
            vals.append(float(b))
    if rows:
        z.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(vals, device=device),
            accumulate=True,
        )
    rows, cols = [], []
    for i, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            rows += [i] * len(s.stop_ids)
            cols += list(s.stop_ids)
    if rows:
        z[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
    if any(s.params.has_penalties for s in seqs):
        _penalise(z, seqs)
    return z


def _penalise(z: torch.Tensor, seqs: Seq[Sequence]) -> None:
    """Repetition (prompt + output), frequency and presence (output) penalties, in place, on seen tokens only."""
    rows, cols, rep, sub = [], [], [], []
    for i, s in enumerate(seqs):
        p = s.params
        if not p.has_penalties:
            continue
        counts = Counter(s.output_token_ids)
        seen = set(counts) | (set(s.prompt_token_ids) if p.repetition_penalty != 1 else set())
        for t in seen:
            c = counts.get(t, 0)
            rows.append(i)
            cols.append(t)
            rep.append(p.repetition_penalty)
            sub.append(p.frequency_penalty * c + (p.presence_penalty if c else 0.0))
    if not rows:
        return
    device = z.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    v = z[index]
    r = torch.tensor(rep, device=device)
    v = torch.where(v > 0, v / r, v * r) - torch.tensor(sub, device=device)
    z.index_put_(index, v)


def _draw_blocked(probs: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative mass exceeds u · total mass, summed ``DRAW_BLOCK`` tokens at a time.

    The mass before each block comes from the block sums (one reduction over the row), the mass
    inside the chosen block from its own running sum, so no running sum over the whole vocabulary is
    written (on CPU that ``cumsum`` is the dearest pass of a plain row's sampling). A rounding that
    lands past the block's mass, or on a zero-probability token, takes the block's most likely
    token (the block holds mass, so it has one).
    """
    rows, vocab = probs.shape
    full = vocab // DRAW_BLOCK * DRAW_BLOCK
    sums = [probs[:, :full].view(rows, -1, DRAW_BLOCK).sum(dim=-1)] if full else []
    if full < vocab:
        sums.append(probs[:, full:].sum(dim=-1, keepdim=True))
    cum = torch.cat(sums, dim=1).cumsum(dim=-1)
    target = u_B[:, None] * cum[:, -1:]
    block = torch.searchsorted(cum, target, right=True).clamp(max=cum.shape[1] - 1)
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)[None, :]
    inside = probs.gather(1, cols.clamp(max=vocab - 1)) * (cols < vocab)
    k = torch.searchsorted(inside.cumsum(dim=-1), target - before, right=True).clamp(max=DRAW_BLOCK - 1)
    k = torch.where(inside.gather(1, k) > 0, k, inside.argmax(dim=-1, keepdim=True))
    return (block * DRAW_BLOCK + k).squeeze(1)


def _sample_truncated(probs: torch.Tensor, u_B: torch.Tensor, params) -> torch.Tensor:
    """Inverse-CDF draw from each row's kept prefix of its tokens sorted by probability.

    top_k, min_p and top_p each keep a prefix of the sorted order, so their intersection is a
    prefix too; top_p is taken over the mass top_k and min_p left. Rank 0 is always kept, so a
    top_p that rounds to 0 in fp32 (1e-46) samples the top token instead of failing.

    Sorting the vocabulary dominates the cost, so only the ``CANDIDATES`` (or top_k, if larger)
    most likely tokens are sorted (``topk``) when a row's kept prefix ends inside them: always
    when every truncating row has a top_k; otherwise, on CPU (where reading the mask back costs
    no device sync), the rows whose prefix reaches the last candidate (or whose top_k is larger)
    are sorted whole; on a GPU every row is sorted whole. The masses top_p is measured against
    come from the unsorted row, so a row keeps and draws the same tokens whichever way it was sorted.
    """
    device, V = probs.device, probs.shape[-1]
    rows = [p.truncates and p.temperature > 0 for p in params]
    ks = [p.top_k for p, r in zip(params, rows) if r]
    all_k = all(k > 0 for k in ks)
    C = min(V, max([CANDIDATES] + ks) if all_k else CANDIDATES)
    if C == V or not (all_k or device.type == "cpu"):
        return _draw(*_kept_prefix(probs, params, V), u_B)
    sorted_p, keep, order = _kept_prefix(probs, params, C)
    tokens = _draw(sorted_p, keep, order, u_B)
    if not all_k:
        # a prefix that reaches the last candidate may go on past it; a top_k beyond C needs the top_k's mass
        spill = [
            i for i, (r, last, p) in enumerate(zip(rows, keep[:, -1].tolist(), params)) if r and (last or p.top_k > C)
        ]
        if spill:
            again = _draw(*_kept_prefix(probs[spill], [params[i] for i in spill], V), u_B[spill])
            tokens[spill] = again
    return tokens


def _kept_prefix(probs: torch.Tensor, params, C: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities, keep mask, token ids) of each row's C most likely tokens, best first; the mask is a prefix."""
    device, V = probs.device, probs.shape[-1]
    sorted_p, order = probs.topk(C, dim=-1) if C < V else probs.sort(dim=-1, descending=True)
    keep = None  # masks only for fields some row uses: for the other rows they would keep everything
    if any(0 < p.top_k < C for p in params):
        k_B = torch.tensor([p.top_k if p.top_k > 0 else C for p in params], device=device)
        keep = torch.arange(C, device=device)[None, :] < k_B[:, None]
    eligible = probs
    if any(p.min_p > 0 for p in params):
        floor_B = torch.tensor([p.min_p for p in params], device=device)[:, None] * sorted_p[:, :1]
        above = sorted_p >= floor_B
        keep = above if keep is None else keep & above
        eligible = probs * (probs >= floor_B)
    kept = sorted_p if keep is None else sorted_p * keep
    cum = kept.cumsum(dim=-1)
    # top_p is a fraction of the top_k prefix's mass (within the sorted columns), else of every eligible token's
    has_k = torch.tensor([0 < p.top_k <= C for p in params], device=device)[:, None]
    mass = torch.where(has_k, cum[:, -1:], eligible.sum(dim=-1, keepdim=True))
    nucleus = (cum - kept) < torch.tensor([p.top_p for p in params], device=device)[:, None] * mass
    keep = nucleus if keep is None else keep & nucleus
    keep[:, 0] = True
    return sorted_p, keep, order


def _draw(sorted_p: torch.Tensor, keep: torch.Tensor, order: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """The first kept token whose cumulative kept mass exceeds u · kept mass."""
    cum = (sorted_p * keep).cumsum(dim=-1)
    idx = torch.searchsorted(cum, (u_B * cum[:, -1])[:, None], right=True)
    idx = idx.clamp(max=keep.sum(-1, keepdim=True) - 1)
    return order.gather(1, idx).squeeze(1)
