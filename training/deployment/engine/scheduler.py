"""Which sequences run in the next step: admission with prefix reuse, compaction, release of slots.

Policy (FIFO, no preemption): waiting requests are admitted in arrival order while fewer than
``max_running`` sequences run and the step's prefill token budget lasts (the first admitted prompt
always fits).

Prefix reuse (automatic prefix caching by copy-on-admit; see the engine README for why):

- A new sequence gets slot ``R`` (the first after the running ones). Its donor is the usable slot
  holding the longest prefix of its prompt: running, cached or parked, computed under the live
  weights, capped at ``len(prompt) - 1`` so at least one token is prefilled for logits. A session's
  own parked slot wins ties, then slot ``R`` itself (reused in place, nothing copied). The donor's
  K/V for that prefix is copied into slot ``R``.
- A request whose prompt equals the prompt of a sequence admitted earlier in the same step (the
  members of a GRPO group, the choices of ``n > 1``) is a follower: nothing is prefilled for it;
  after the step's prefill the leader's prompt K/V is copied into its slot and it samples its first
  token from the leader's logits (``cached_prompt_tokens = len(prompt)``).
- Cached content already in slot ``R`` swaps places with a cached donor, or moves to the least
  valuable non-running slot other than the donor, unless it is itself the least valuable: then it
  is the one evicted (LRU within the slots). The donor is pinned until its prefix is copied: the
  donor of an admission is never its eviction victim, even when it is the least recently used.

Release: a finished sequence's slot becomes PARKED under its session id, or CACHED, holding the
tokens whose K/V is valid, when that K/V was computed under the live weights; else EMPTY.
``compact`` (before every admission and decode) moves running sequences above ``R`` into the holes
below it; a hole's cached content is swapped out through the scratch slot, not lost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from training.deployment.engine.kv_cache import SlotState, SlotTable
from training.deployment.engine.model_runner import PrefillItem
from training.deployment.engine.sequence import Sequence, SequenceStatus


@dataclass
class Admission:
    """One step's admissions: sequences to prefill, and followers that share a leader's prompt and logits."""

    prefill: list[tuple[Sequence, PrefillItem]] = field(default_factory=list)
    followers: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    """(follower, leader): identical prompts admitted in the same step; the leader is in ``prefill``."""

    def __bool__(self) -> bool:
        return bool(self.prefill)


class Scheduler:
    """Owns the waiting queue, the running set and the slot table; moves K/V through ``copy_kv``."""

    def __init__(
        self,
        num_slots: int,
        max_running: int,
        max_model_len: int,
        max_prefill_tokens: int,
        copy_kv: Callable[[int, int, int], None],
        scratch_slot: int,
        prefix_caching: bool = True,
    ):
        self.slots = SlotTable(num_slots, max_model_len)
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.copy_kv = copy_kv
        """``copy_kv(src, dst, n)``: K/V positions ``[0, n)`` of slot ``src`` into slot ``dst``."""
        self.scratch_slot = scratch_slot
        self.prefix_caching = prefix_caching
        self.weight_epoch = 0
        """Counts weight swaps (a version number may repeat): only K/V computed in this epoch is reused."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admitting = True
        """False while a weight update drains the running batch."""

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.running) or (self.admitting and bool(self.waiting))

    # ----------------------------------------------------------------- admission
    def admit(self) -> Admission:
        """Move waiting sequences into slots ``R, R+1, ...``; return what to prefill and the followers."""
        self.compact()
        adm = Admission()
        budget = self.max_prefill_tokens
        leaders: dict[tuple[int, ...], Sequence] = {}
        running_in = {s.slot: s for s in self.running}
        while self.admitting and self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            target = len(self.running)
            leader = leaders.get(tuple(seq.prompt_token_ids)) if self.prefix_caching else None
            if leader is not None:
                self.waiting.popleft()
                self._make_room(target, donor=-1)
                self._start(seq, target, reuse=0)
                seq.cached_prompt_tokens = seq.num_prompt_tokens
                seq.kv_origin, seq.kv_origin_len = leader.kv_origin, min(leader.kv_origin_len, seq.num_prompt_tokens)
                adm.followers.append((seq, leader))
                continue
            donor, reuse = self._find_donor(seq, target)
            if adm.prefill and seq.num_prompt_tokens - reuse > budget:
                break
            self.waiting.popleft()
            donor = self._make_room(target, donor, seq.session_id)
            if reuse:
                self.copy_kv(donor, target, reuse)
                self.slots.touch(donor)
                if self.slots.session[donor] == seq.session_id:
                    self.slots.unpark(donor)  # the session moves on; its old turn stays as plain cache
            self._start(seq, target, reuse)
            if donor in running_in:  # a copy of a running sequence's K/V: shared with it at decode
                origin = running_in[donor]
                seq.kv_origin, seq.kv_origin_len = origin.kv_origin, min(origin.kv_origin_len, reuse)
            adm.prefill.append((seq, PrefillItem(target, seq.prompt_token_ids[reuse:], reuse)))
            leaders[tuple(seq.prompt_token_ids)] = seq
            budget -= seq.num_prompt_tokens - reuse
        return adm

    def prefilled(self, adm: Admission) -> None:
        """After the step's prefill: prompts have K/V; copy each leader's into its followers' slots."""
        for seq, _ in adm.prefill:
            self.slots.valid_len[seq.slot] = seq.num_prompt_tokens
        for seq, leader in adm.followers:
            self.copy_kv(leader.slot, seq.slot, seq.num_prompt_tokens)
            seq.num_cached = seq.num_prompt_tokens
            self.slots.valid_len[seq.slot] = seq.num_prompt_tokens

    def _find_donor(self, seq: Sequence, target: int) -> tuple[int, int]:
        """(slot, tokens) of the best prefix to reuse: (-1, 0) when nothing is reusable."""
        parked = self.slots.parked.get(seq.session_id) if seq.session_id is not None else None
        if not self.prefix_caching and parked is None:
            return -1, 0
        lengths = self.slots.prefix_lengths(seq.prompt_token_ids, self.weight_epoch)
        lengths.clamp_(max=seq.num_prompt_tokens - 1)
        if not self.prefix_caching:
            n = int(lengths[parked])
            return (parked, n) if n > 0 else (-1, 0)
        best = int(lengths.max())
        if best <= 0:
            return -1, 0
        for preferred in (parked, target if target < self.slots.num_slots else None):
            if preferred is not None and int(lengths[preferred]) == best:
                return preferred, best
        return int(lengths.argmax()), best

    def _make_room(self, target: int, donor: int, session_id: Optional[str] = None) -> int:
        """Free slot ``target`` for a new sequence whose prefix comes from ``donor``; returns where the donor now is.

        A donor that the new sequence consumes (anonymous cache, or its own session's parked slot)
        swaps places with ``target``'s content and is used in place: nothing is evicted.
        Otherwise ``target``'s content moves to the least valuable other non-running slot, or is
        evicted when it is itself the least valuable. The donor is pinned for this admission: it is
        never the slot written over, so its K/V is intact when the prefix is copied from it.
        """
        slots = self.slots
        if target == donor or slots.state[target] == SlotState.EMPTY:
            return donor
        if donor >= 0 and (
            slots.state[donor] == SlotState.CACHED
            or (slots.state[donor] == SlotState.PARKED and slots.session[donor] == session_id)
        ):
            self._swap(target, donor)
            return target
        victim = slots.victim(s for s in range(len(self.running) + 1, slots.num_slots) if s != donor)
        if victim is not None and slots.rank(victim) < slots.rank(target):
            self.copy_kv(target, victim, slots.valid_len[target])
            slots.move(target, victim)
        else:
            slots.clear(target)
        return donor

    def _swap(self, a: int, b: int) -> None:
        """Exchange the K/V and descriptions of two slots through the scratch slot."""
        n_a, n_b = self.slots.valid_len[a], self.slots.valid_len[b]
        self.copy_kv(a, self.scratch_slot, n_a)
        self.copy_kv(b, a, n_b)
        self.copy_kv(self.scratch_slot, b, n_a)
        self.slots.swap(a, b)

    def _start(self, seq: Sequence, slot: int, reuse: int) -> None:
        seq.slot = slot
        seq.num_cached = reuse
        seq.cached_prompt_tokens = reuse
        seq.status = SequenceStatus.RUNNING
        seq.kv_origin, seq.kv_origin_len = seq.seq_id, seq.num_prompt_tokens  # its own prefill
        self.running.append(seq)
        # content counts once prefilled (``prefilled``); until then no other request may copy from it
        self.slots.write(slot, SlotState.RUNNING, seq.prompt_token_ids, 0, self.weight_epoch)

    # ----------------------------------------------------------------- compaction and release
    def compact(self) -> None:
        """Move running sequences into slots ``[0, R)`` (``R`` = number running), keeping cached content."""
        r = len(self.running)
        holes = [s for s in range(r) if self.slots.state[s] != SlotState.RUNNING]
        if not holes:
            return
        movers = sorted((s for s in self.running if s.slot >= r), key=lambda s: s.slot, reverse=True)
        for hole, seq in zip(holes, movers):
            src, n_hole = seq.slot, self.slots.valid_len[hole]
            if self.slots.state[hole] != SlotState.EMPTY and n_hole:
                scratch = self.scratch_slot  # swap: the hole's cached content ends up in the mover's old slot
                self.copy_kv(hole, scratch, n_hole)
                self.copy_kv(src, hole, seq.num_cached)
                self.copy_kv(scratch, src, n_hole)
                self.slots.swap(hole, src)
            else:
                self.copy_kv(src, hole, seq.num_cached)
                self.slots.clear(hole)
                self.slots.move(src, hole)
            seq.slot = hole

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its slot (cached, parked for its session, or emptied)."""
        seq.finish_reason = reason
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            slot, slots = seq.slot, self.slots
            fresh = seq.num_cached > 0 and slots.version[slot] == self.weight_epoch
            if fresh and seq.session_id is not None and reason != "abort":
                slots.write(
                    slot, SlotState.PARKED, seq.token_ids, seq.num_cached, self.weight_epoch, session=seq.session_id
                )
            elif fresh and self.prefix_caching:
                slots.write(slot, SlotState.CACHED, seq.token_ids, seq.num_cached, self.weight_epoch)
            else:
                slots.clear(slot)
            seq.slot = -1
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def weights_changed(self) -> int:
        """New live weights: no cached or parked K/V is reusable any more. Returns the sessions dropped.

        Running slots keep the version their K/V was computed under (so they are never donors
        again) unless the engine recomputes their K/V and calls ``mark_recomputed``.
        """
        self.weight_epoch += 1
        return self.slots.drop_reusable()

    def mark_recomputed(self, seq: Sequence) -> None:
        """``seq``'s K/V was recomputed under the live weights (by its own computation: shared with no one)."""
        self.slots.version[seq.slot] = self.weight_epoch
        seq.kv_origin, seq.kv_origin_len = seq.seq_id, seq.num_cached
