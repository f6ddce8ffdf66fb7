"""Which sequences run in the next step: admission to KV slots, session reuse, and release.

Policy (FIFO, no preemption): waiting requests are admitted in arrival order while a slot can be
had (free, or by evicting the least-recently-used parked session) and the step's prefill token
budget lasts (the first admitted prompt always fits). A request whose ``session_id`` has a parked
slot takes that slot back and keeps the K/V of the longest common prefix of its prompt and the
parked tokens (at most ``len(prompt) - 1``, so at least one token is prefilled to get logits).
Finished sequences free their slot at once, or park it when they carry a ``session_id``.
"""

from __future__ import annotations

from collections import deque

from training.deployment.engine.kv_cache import SlotTable, common_prefix_len
from training.deployment.engine.model_runner import PrefillItem
from training.deployment.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Owns the waiting queue, the running set and the slot table."""

    def __init__(self, num_slots: int, max_prefill_tokens: int):
        self.slots = SlotTable(num_slots)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admitting = True
        """False while a weight update drains the running batch."""

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.running) or (self.admitting and bool(self.waiting))

    def admit(self) -> list[tuple[Sequence, PrefillItem]]:
        """Move waiting sequences into slots; return them with the tokens each must prefill."""
        admitted: list[tuple[Sequence, PrefillItem]] = []
        budget = self.max_prefill_tokens
        while self.admitting and self.waiting:
            seq = self.waiting[0]
            parked = self.slots.parked.get(seq.session_id) if seq.session_id is not None else None
            reuse = 0
            if parked is not None:
                reuse = min(common_prefix_len(seq.prompt_token_ids, parked.token_ids), parked.kv_len,
                            seq.num_prompt_tokens - 1)
            new_tokens = seq.num_prompt_tokens - reuse
            if admitted and new_tokens > budget:
                break
            if parked is None and not self.slots.can_allocate():
                break
            self.waiting.popleft()
            if parked is not None:
                self.slots.take_parked(seq.session_id)
                seq.slot = parked.slot
            else:
                seq.slot = self.slots.allocate()
            seq.num_cached = reuse
            seq.cached_prompt_tokens = reuse
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append((seq, PrefillItem(seq.slot, seq.prompt_token_ids[reuse:], reuse)))
            budget -= new_tokens
        return admitted

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its slot (free it, or park it for its session)."""
        seq.finish_reason = reason
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            if seq.session_id is not None and reason != "abort":
                self.slots.park(seq.session_id, seq.slot, seq.token_ids, kv_len=len(seq.token_ids) - 1)
            else:
                self.slots.free(seq.slot)
            seq.slot = -1
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
