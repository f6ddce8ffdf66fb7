"""Packing variable-length sequences into padding-free micro-batches.

A micro-batch is one flat row of ``N`` tokens holding ``S`` whole sequences back to back.
Invariants of every ``PackedBatch`` made by ``pack_sequences``:

- a sequence is never split across micro-batches;
- ``N <= max_tokens``, except for a sequence longer than ``max_tokens``, which is packed
  alone (``S == 1``);
- ``position_ids_N`` restarts at 0 at the first token of every sequence;
- tokens of different sequences never attend to each other: ``attention_mask`` builds the
  block-diagonal causal mask that the model is run with.

With ``share_prefixes=True`` sequences that start with the same tokens (a GRPO group's prompt)
are packed together and carry a ``SharedPrefixLayout`` (``prefix_sharing.py``): the model runs
on that layout, computing the common prefix once, and the micro-batch budget counts its rows.
The fields above still describe the ordinary layout, which is what a loss sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from training.trainer.prefix_sharing import SharedPrefixLayout, build_shared_layout, prefix_groups


@dataclass
class PackedBatch:
    """One packed micro-batch of whole sequences (all tensors on CPU until moved)."""

    input_ids_N: torch.Tensor
    """Token ids of all sequences concatenated, long ``[N]``."""
    position_ids_N: torch.Tensor
    """Position of each token inside its own sequence (0 at each sequence start), long ``[N]``."""
    sequence_index_N: torch.Tensor
    """Which sequence of this micro-batch (0..S-1) each token belongs to, long ``[N]``."""
    sample_indices: list[int]
    """For each of the S sequences, its index in the list given to ``pack_sequences``."""
    lengths: list[int]
    """Length of each of the S sequences; ``sum(lengths) == N``."""
    shared: Optional[SharedPrefixLayout] = None
    """The compute layout when some sequences share a prefix (computed once); None = run ``input_ids_N`` as is."""

    @property
    def num_compute_tokens(self) -> int:
        """Rows the model runs: ``num_tokens``, fewer with a shared layout."""
        return self.num_tokens if self.shared is None else self.shared.num_compute_tokens

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_N.numel())

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def gather(
        self, per_sample: Union[Sequence[Sequence[float]], Sequence[float]], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Build an ``[N]`` tensor from values indexed like the original sequence list.

        ``per_sample[i]`` is either a list with one value per token of sequence ``i``
        (concatenated here in packing order) or a scalar (repeated over that sequence's tokens).
        Only the entries named by ``sample_indices`` are read. The result is on the device of
        ``input_ids_N``.
        """
        device = self.input_ids_N.device
        parts: list[torch.Tensor] = []
        for sample_index, length in zip(self.sample_indices, self.lengths):
            value = per_sample[sample_index]
            if isinstance(value, (int, float, bool)) or (isinstance(value, torch.Tensor) and value.ndim == 0):
                parts.append(torch.full((length,), float(value), dtype=dtype, device=device))
                continue
            values_T = torch.as_tensor(value, dtype=dtype, device=device)
            if values_T.ndim != 1 or values_T.numel() != length:
                raise ValueError(
                    f"per_sample[{sample_index}]: expected a scalar or {length} per-token values, "
                    f"got shape {tuple(values_T.shape)}"
                )
            parts.append(values_T)
        return torch.cat(parts)

    def split(self, values_N: torch.Tensor) -> list[torch.Tensor]:
        """Split an ``[N]`` tensor into the S per-sequence pieces (views), in packing order."""
        return list(torch.split(values_N, self.lengths))

    def is_sequence_start_N(self) -> torch.Tensor:
        """Bool ``[N]``: True at the first token of each sequence."""
        return self.position_ids_N == 0

    def to(self, device: Union[str, torch.device]) -> "PackedBatch":
        """A copy with the tensors on ``device``."""
        return PackedBatch(
            self.input_ids_N.to(device),
            self.position_ids_N.to(device),
            self.sequence_index_N.to(device),
            list(self.sample_indices),
            list(self.lengths),
            None if self.shared is None else self.shared.to(device),
        )

    def attention_mask(self, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """Block-diagonal causal mask ``[1, 1, N, N]``: query i may see key j iff both are in the
        same sequence and j <= i.

        ``dtype=torch.bool`` gives True where attention is allowed (for ``sdpa``); a float dtype
        gives an additive mask, 0 where allowed and the dtype's minimum elsewhere (for ``eager``).
        """
        seq_N = self.sequence_index_N
        n = seq_N.numel()
        idx_N = torch.arange(n, device=seq_N.device)
        allowed_NN = (seq_N[:, None] == seq_N[None, :]) & (idx_N[None, :] <= idx_N[:, None])
        if dtype == torch.bool:
            return allowed_NN[None, None]
        additive_NN = torch.zeros((n, n), dtype=dtype, device=seq_N.device)
        additive_NN.masked_fill_(~allowed_NN, torch.finfo(dtype).min)
        return additive_NN[None, None]


Unit = tuple[list[int], int]
"""What is packed as a whole: ``(members, prefix_len)``; one sequence has ``prefix_len == 0``,
a group of sequences sharing their first ``prefix_len`` tokens has ``prefix_len > 0``."""


def unit_tokens(sequences: Sequence[Sequence[int]], unit: Unit) -> int:
    """Rows a unit computes: the prefix once plus every member's own tokens."""
    members, prefix_len = unit
    return prefix_len + sum(len(sequences[i]) - prefix_len for i in members)


def plan_units(sequences: Sequence[Sequence[int]], max_tokens: int, share_prefixes: bool = False) -> list[Unit]:
    """The units to pack: one per sequence, or (``share_prefixes``) groups found by ``prefix_groups``.

    A group larger than ``max_tokens`` is cut into consecutive chunks of members that fit (each
    chunk shares the prefix again); a chunk of one member becomes a plain sequence. Units are
    ordered by their first member.
    """
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequences[{i}]: empty sequence")
    if not share_prefixes:
        return [([i], 0) for i in range(len(sequences))]
    units: list[Unit] = []
    for members, prefix_len in prefix_groups(sequences):
        chunk: list[int] = []
        for i in members:
            if chunk and unit_tokens(sequences, (chunk + [i], prefix_len)) > max_tokens:
                units.append((chunk, prefix_len if len(chunk) > 1 else 0))
                chunk = []
            chunk.append(i)
        units.append((chunk, prefix_len if len(chunk) > 1 else 0))
    return sorted(units, key=lambda u: u[0][0])


def pack_units(sequences: Sequence[Sequence[int]], units: Sequence[Unit], max_tokens: int) -> list[PackedBatch]:
    """First-fit packing of whole units by the rows they compute (``unit_tokens``); see ``pack_sequences``."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens: must be > 0, got {max_tokens}")
    bins: list[list[Unit]] = []
    room: list[int] = []
    for unit in units:
        n = unit_tokens(sequences, unit)
        if n > max_tokens:
            bins.append([unit])
            room.append(0)
            continue
        for b, free in enumerate(room):
            if free >= n:
                bins[b].append(unit)
                room[b] -= n
                break
        else:
            bins.append([unit])
            room.append(max_tokens - n)
    return [_make_batch(sequences, members) for members in bins]


def _make_batch(sequences: Sequence[Sequence[int]], units: list[Unit]) -> PackedBatch:
    members = [i for unit_members, _ in units for i in unit_members]
    lengths = [len(sequences[i]) for i in members]
    input_ids_N = torch.tensor([tok for i in members for tok in sequences[i]], dtype=torch.long)
    position_ids_N = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
    sequence_index_N = torch.repeat_interleave(
        torch.arange(len(lengths), dtype=torch.long), torch.tensor(lengths, dtype=torch.long)
    )
    shared = build_shared_layout(sequences, units) if any(p > 0 for _, p in units) else None
    return PackedBatch(input_ids_N, position_ids_N, sequence_index_N, members, lengths, shared)


def pack_sequences(
    sequences: Sequence[Sequence[int]], max_tokens: int, share_prefixes: bool = False
) -> list[PackedBatch]:
    """First-fit packing of ``sequences`` into micro-batches of at most ``max_tokens`` computed tokens.

    Sequences are visited in order; each goes into the first open micro-batch with room for it
    (so the packing is deterministic and keeps the input order inside each micro-batch). A
    sequence longer than ``max_tokens`` gets a micro-batch of its own. Empty sequences are an
    error (they have no token to train or score). With ``share_prefixes`` the same holds for
    units (``plan_units``: groups sharing a prefix, kept in one micro-batch) instead of sequences.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens: must be > 0, got {max_tokens}")
    return pack_units(sequences, plan_units(sequences, max_tokens, share_prefixes), max_tokens)
