"""Shared-prompt packing: sequences that start with the same tokens compute that prefix once.

A GRPO group's completions all start with the group's prompt. In the shared layout a group of
``G`` sequences with a common prefix of ``P`` tokens is laid out as the prefix once, then each
member's own tokens (its suffix) one after the other::

    compute row:  [ prefix (P) | suffix_1 (L_1 - P) | suffix_2 (L_2 - P) | ... ]
    positions:      0 .. P-1     P .. L_1 - 1          P .. L_2 - 1

Attention (``training/trainer/model.py``, ``packed_sdpa``): prefix rows attend causally to the
prefix; suffix ``k`` rows attend to all prefix keys and causally to suffix ``k`` (never to
another suffix). Every hidden state is then the one the unshared forward of that member
computes, so the logprobs are the same up to float summation order; the prefix's K/V get
gradient from every member through the attention. The layer work (projections, MLP, LM head)
runs on ``P + sum(L_k - P)`` rows instead of ``sum(L_k)``.

Logprobs: the hidden state at compute row ``r`` predicts one target token per *pair*; a prefix
row predicts the next prefix token once for all members, the prefix's last row predicts each
member's first suffix token (one pair per member), a suffix row the member's next token. There
are ``C - 1`` pairs for ``C`` compute rows per group, the same count as without sharing, and
``source_N`` maps each token of the ordinary (unshared) layout to its pair, so the loss sees
the usual ``[N]`` logprobs; a pair used by several members gets the sum of their gradients.

Groups are found from the token ids alone (``prefix_groups``): nothing upstream marks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

MIN_SHARED_PREFIX = 2
"""Shortest common prefix (tokens) worth sharing: below it the extra attention calls cost more
than the rows they save."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_groups(
    sequences: Sequence[Sequence[int]], min_prefix: int = MIN_SHARED_PREFIX
) -> list[tuple[list[int], int]]:
    """Partition ``sequences`` into groups that share a prefix: ``[(members, prefix_len)]``.

    ``members`` are indices into ``sequences`` (increasing); ``prefix_len`` is the tokens the
    group computes once: at most the members' common prefix, and at most the shortest member's
    length - 1, so every member keeps at least one token of its own. Singletons have
    ``prefix_len == 0``. The partition maximises the rows saved, ``sum((G - 1) * prefix_len)``,
    over the groupings that the sorted order allows: sequences are sorted, and a range of them
    is either one group (its prefix is the smallest common prefix of neighbours) or split where
    that smallest common prefix is reached (a prompt's own group beats one shared system prompt).
    Deterministic; groups are ordered by their first member.
    """
    order = sorted(range(len(sequences)), key=lambda i: (list(sequences[i]), i))
    lcp = [_common_prefix(sequences[order[k]], sequences[order[k + 1]]) for k in range(len(order) - 1)]
    groups: list[tuple[list[int], int]] = []

    def best(lo: int, hi: int) -> tuple[int, list[tuple[int, int, int]]]:
        """Saved rows and groups ``(lo, hi, prefix)`` for ``order[lo:hi]`` (recursive: fine for n up to a
        few hundred)."""
        if hi - lo == 1:
            return 0, [(lo, hi, 0)]
        low = min(lcp[lo : hi - 1])
        prefix = min(low, min(len(sequences[order[k]]) for k in range(lo, hi)) - 1)
        whole = (hi - lo - 1) * prefix if prefix >= min_prefix else 0
        # split where the neighbours' common prefix is smallest: each part may share more
        cuts = [k + 1 for k in range(lo, hi - 1) if lcp[k] == low]
        saved, parts = 0, []
        for a, b in zip([lo, *cuts], [*cuts, hi]):
            s, p = best(a, b)
            saved += s
            parts += p
        if whole > saved:
            return whole, [(lo, hi, prefix)]
        if saved == 0:
            return 0, [(k, k + 1, 0) for k in range(lo, hi)]
        return saved, parts

    if sequences:
        for lo, hi, prefix in best(0, len(order))[1]:
            members = sorted(order[lo:hi])
            if prefix == 0:
                groups.extend(([m], 0) for m in members)
            else:
                groups.append((members, prefix))
    return sorted(groups, key=lambda g: g[0][0])


@dataclass
class AttentionSpan:
    """Query rows ``[start, end)`` of the compute row and the context they see before themselves."""

    start: int
    end: int
    context_start: int = 0
    """Keys ``[context_start, context_end)`` (the shared prefix) that every row of the span sees in full."""
    context_end: int = 0

    @property
    def has_context(self) -> bool:
        return self.context_end > self.context_start


@dataclass
class SharedPrefixLayout:
    """The compute row of a packed micro-batch with shared prefixes (see the module docstring).

    ``C`` = compute rows, ``M = C - 1``-ish pairs (one per predicted token), ``N`` = tokens of
    the ordinary layout (``PackedBatch.input_ids_N``).
    """

    input_ids_C: torch.Tensor
    """Token ids of the compute row, long ``[C]``."""
    position_ids_C: torch.Tensor
    """Position of each compute row inside its own sequence (suffixes continue after the prefix), long ``[C]``."""
    spans: list[AttentionSpan]
    """Attention spans in order; together they cover the compute row once."""
    span_masks: list[Optional[torch.Tensor]]
    """Per span with context: bool ``[end - start, context + end - start]``, True where a query may
    attend (all context keys; its own keys causally); None for a plain causal span."""
    predictor_M: torch.Tensor
    """Compute row whose hidden state predicts pair m, long ``[M]``."""
    target_M: torch.Tensor
    """Token id predicted by pair m, long ``[M]``."""
    source_N: torch.Tensor
    """For each token of the ordinary layout: 0 at a sequence start (logprob 0), else 1 + its pair, long ``[N]``."""
    attention_calls: int = field(default=0, compare=False)
    """How many attention layers ran this layout (checked after a forward: a model that ignores it must fail)."""

    @property
    def num_compute_tokens(self) -> int:
        return int(self.input_ids_C.numel())

    def to(self, device: Union[str, torch.device]) -> "SharedPrefixLayout":
        return SharedPrefixLayout(
            self.input_ids_C.to(device),
            self.position_ids_C.to(device),
            list(self.spans),
            [None if m is None else m.to(device) for m in self.span_masks],
            self.predictor_M.to(device),
            self.target_M.to(device),
            self.source_N.to(device),
        )


def build_shared_layout(
    sequences: Sequence[Sequence[int]], units: Sequence[tuple[list[int], int]]
) -> SharedPrefixLayout:
    """The shared layout of ``units`` (``(members, prefix_len)``, prefix 0 = one plain sequence)
    in order; the ordinary layout is the members' full sequences in the same order."""
    ids: list[int] = []
    positions: list[int] = []
    spans: list[AttentionSpan] = []
    masks: list[Optional[torch.Tensor]] = []
    predictor: list[int] = []
    target: list[int] = []
    source: list[int] = []

    def plain(tokens: Sequence[int], first_position: int) -> tuple[int, int]:
        start = len(ids)
        ids.extend(tokens)
        positions.extend(range(first_position, first_position + len(tokens)))
        return start, len(ids)

    for members, prefix_len in units:
        if prefix_len == 0:
            (member,) = members
            seq = sequences[member]
            start, end = plain(seq, 0)
            spans.append(AttentionSpan(start, end))
            masks.append(None)
            source.append(0)
            for t in range(1, len(seq)):
                source.append(len(target) + 1)
                predictor.append(start + t - 1)
                target.append(seq[t])
            continue
        prefix = sequences[members[0]][:prefix_len]
        p_start, p_end = plain(prefix, 0)
        spans.append(AttentionSpan(p_start, p_end))
        masks.append(None)
        prefix_pairs = []  # pair of prefix token t (t >= 1), shared by all members
        for t in range(1, prefix_len):
            prefix_pairs.append(len(target) + 1)
            predictor.append(p_start + t - 1)
            target.append(prefix[t])
        for member in members:
            seq = sequences[member]
            s_start, s_end = plain(seq[prefix_len:], prefix_len)
            spans.append(AttentionSpan(s_start, s_end, p_start, p_end))
            length = s_end - s_start
            masks.append(torch.ones(length, prefix_len + length, dtype=torch.bool).tril(diagonal=prefix_len))
            source.append(0)
            source.extend(prefix_pairs)
            for t in range(prefix_len, len(seq)):
                source.append(len(target) + 1)
                predictor.append(p_end - 1 if t == prefix_len else s_start + t - prefix_len - 1)
                target.append(seq[t])
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return SharedPrefixLayout(
        as_long(ids), as_long(positions), spans, masks, as_long(predictor), as_long(target), as_long(source)
    )
