"""Which sequences run in the next step: admission with prefix reuse, blocks for decode, preemption, release.

Admission (FIFO): waiting sequences are admitted in arrival order while fewer than ``max_running``
run, the step's prefill token budget lasts (the first admitted prompt always fits) and the pool can
give the blocks their prompt needs (``can_allocate``: the blocks not held by running sequences, less a
watermark of 1 % while something runs, so that admission does not preempt at once).

Prefix reuse (automatic prefix caching; block_manager.py holds the tree):

- A new sequence shares, block for block, the longest chain of full cached blocks holding its prompt's
  first tokens (held once, reference-counted: a GRPO group's prompt is stored once), capped at
  ``len(prompt) - 1`` so at least one token is prefilled for logits. The partial block after it is
  *copied* (the positions that match) from the best donor: a cached partial block (a finished turn's
  end), a full cached block the prompt leaves mid-block, or a running sequence's last block. Blocks
  registered earlier in the same admission are shared too: their prefill is in the same batch.
- A request whose prompt equals the prompt of a sequence admitted earlier in the same step (the members
  of a GRPO group, the choices of ``n > 1``) is a follower: nothing is prefilled for it; it shares the
  leader's full prompt blocks, gets a copy of the leader's last partial block after the prefill, and
  samples its first token from the leader's logits (``cached_prompt_tokens = len(prompt)``).
- Sessions: a finished turn stays PARKED (its blocks pinned) until the session's next turn is admitted,
  which then lets it go (it stays as plain cache). With ``prefix_caching`` off only a session's own
  parked turn is reused (its blocks private, not in the tree).
- Only K/V computed in the live weight epoch is shared or registered (``kv_epoch``).

Decode (``schedule_decode``): every running sequence needs a block for the position its last token is
written to (``may_append``). When none is left, the youngest running sequence (latest arrival) is
preempted: its blocks are released (registered ones stay cached) and it goes back to the front of the
waiting queue with its tokens, logprobs, versions and generator; when admitted again its K/V is
recomputed (prefilled, or shared from blocks still cached) and nothing is sampled for it, so it
continues exactly where it stopped. The oldest running sequence is never preempted while younger ones
run, so it always progresses. Newly filled blocks are registered after every step.

Release (``finish``): a finished sequence's blocks are registered (the last, partial one too) and,
for a session, parked; then released: unheld registered blocks are cached (LRU), the rest freed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from training.deployment.engine.runners.attention import SharedPrefix
from training.deployment.engine.block_manager import BlockManager
from training.deployment.engine.runners.lean import PrefillItem
from training.deployment.engine.sequence import Sequence, SequenceStatus

WATERMARK_FRACTION = 0.01
"""Blocks admission leaves free while something runs (vLLM's 1 %), so new sequences do not preempt at once."""


@dataclass
class Prefill:
    """One sequence's prefill: ``item`` for the runner; ``sample`` False for a preempted sequence's recompute."""

    seq: Sequence
    item: PrefillItem
    sample: bool = True


@dataclass
class Admission:
    """One step's admissions: sequences to prefill, and followers that share a leader's prompt and logits."""

    prefill: list[Prefill] = field(default_factory=list)
    followers: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    """(follower, leader): identical prompts admitted in the same step; the leader is in ``prefill``."""
    pending: list[int] = field(default_factory=list)
    """Blocks registered before this step's prefill computes them (ready after ``Scheduler.prefilled``)."""

    def __bool__(self) -> bool:
        return bool(self.prefill)


@dataclass
class Reuse:
    """What an admission takes over: ``shared`` full blocks, and ``copy`` positions of block ``donor``."""

    shared: list[int] = field(default_factory=list)
    donor: int = -1
    copy: int = 0


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Scheduler:
    """Owns the waiting queue, the running set and the block manager; copies K/V through ``copy_block``."""

    def __init__(
        self,
        blocks: BlockManager,
        max_running: int,
        max_prefill_tokens: int,
        copy_block: Callable[[int, int, int], None],
        prefix_caching: bool = True,
    ):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.copy_block = copy_block
        """``copy_block(src, dst, n)``: K/V of the first ``n`` positions of block ``src`` into block ``dst``."""
        self.prefix_caching = prefix_caching
        self.watermark = int(WATERMARK_FRACTION * blocks.num_blocks)
        self.weight_epoch = 0
        """Counts weight swaps (a version number may repeat): only K/V computed in this epoch is reused."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admitting = True
        """False while a weight update drains the running batch."""
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.running) or (self.admitting and bool(self.waiting))

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, blocks: int) -> bool:
        """Whether ``blocks`` more can be held now (a watermark kept while anything runs)."""
        return blocks <= self.blocks.capacity() - (self.watermark if self.running else 0)

    # ----------------------------------------------------------------- admission
    def admit(self) -> Admission:
        """Give waiting sequences their blocks (shared, copied, new); return what to prefill and the followers."""
        adm = Admission()
        budget = self.max_prefill_tokens
        leaders: dict[tuple[int, ...], Sequence] = {}
        admitted: set[int] = set()
        bs = self.block_size
        while self.admitting and self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            resumed = seq.num_output_tokens > 0  # preempted: its K/V is recomputed, nothing sampled
            target = len(seq.token_ids) - 1 if resumed else seq.num_prompt_tokens
            leader = leaders.get(tuple(seq.prompt_token_ids)) if self.prefix_caching and not resumed else None
            if leader is not None:
                full, part = divmod(target, bs)
                if not self.can_allocate(1 if part else 0):
                    break
                self.waiting.popleft()
                table = leader.block_table[:full]
                for b in table:
                    self.blocks.hold(b)
                self._start(seq, table + ([self.blocks.allocate()] if part else []), 0)
                seq.cached_prompt_tokens = target
                adm.followers.append((seq, leader))
                admitted.add(seq.seq_id)
                continue
            reuse = self._find_reuse(seq, target - (0 if resumed else 1), admitted)
            reused = len(reuse.shared) * bs + reuse.copy
            fresh = self.blocks_needed(target) - len(reuse.shared)
            cost = fresh + sum(self.blocks.ref[b] == 0 for b in reuse.shared)
            cost += reuse.copy > 0 and self.blocks.ref[reuse.donor] == 0
            if adm.prefill and target - reused > budget:
                break
            if not self.can_allocate(cost):
                break
            self.waiting.popleft()
            self._start(seq, self._take(reuse, fresh), reused)
            if not resumed:
                seq.cached_prompt_tokens = reused
            if seq.session_id is not None:
                self.blocks.unpark(seq.session_id)  # the session moves on; its old turn stays as plain cache
            if target > reused:
                item = PrefillItem(seq.block_table, seq.token_ids[reused:target], reused)
                adm.prefill.append(Prefill(seq, item, sample=not resumed))
            if self.prefix_caching:  # its prompt blocks, computed by this step's prefill: shareable already
                first = seq.num_registered
                self._register(seq, target // bs, ready=False, switch=False)
                adm.pending += seq.block_table[first : seq.num_registered]
            if not resumed:
                leaders[tuple(seq.prompt_token_ids)] = seq
            admitted.add(seq.seq_id)
            budget -= target - reused
        return adm

    def prefilled(self, adm: Admission) -> None:
        """After the step's prefill: its blocks are ready; copy each leader's last partial block to its followers."""
        self.blocks.mark_ready(adm.pending)
        for p in adm.prefill:
            p.seq.num_cached = p.item.start_pos + len(p.item.token_ids)
        for seq, leader in adm.followers:
            full, part = divmod(seq.num_prompt_tokens, self.block_size)
            if part:
                self.copy_block(leader.block_table[full], seq.block_table[full], part)
            seq.num_cached = seq.num_prompt_tokens

    def prefill_failed(self, adm: Admission) -> None:
        """The step's prefill raised: its pending blocks never got their K/V, so nobody may share them."""
        self.blocks.forget_pending(adm.pending)

    def _find_reuse(self, seq: Sequence, limit: int, admitted: set[int]) -> Reuse:
        """The blocks to share and the partial block to copy for ``seq.token_ids[:limit]`` (at most ``limit`` positions)."""
        tokens, bs = seq.token_ids, self.block_size
        if not self.prefix_caching:
            turn = self.blocks.parked.get(seq.session_id) if seq.session_id is not None else None
            if turn is None:
                return Reuse()
            n = min(_common(tokens[:limit], turn.tokens), limit)
            return Reuse(turn.blocks[: n // bs], turn.blocks[n // bs] if n % bs else -1, n % bs)
        shared = self.blocks.match(tokens, limit)
        depth = len(shared)
        start = depth * bs
        out = Reuse(shared)
        if start >= limit:
            return out
        want = tokens[start:limit]
        last = shared[-1] if shared else None
        for node in self.blocks.tail_candidates(last, want[0]):
            n = _common(want, list(node.tokens))
            if n > out.copy:
                out.donor, out.copy = node.block, n
        for r in self.running:  # a running sequence's last block (registered once it is full)
            if (
                r.seq_id in admitted
                or r.kv_epoch != self.weight_epoch
                or r.num_registered != depth
                or len(r.block_table) <= depth
                or (depth and r.block_table[depth - 1] != last)
            ):
                continue
            n = _common(want, r.token_ids[start : min(r.num_cached, start + bs)])
            if n > out.copy:
                out.donor, out.copy = r.block_table[depth], n
        return out

    def _take(self, reuse: Reuse, fresh: int) -> list[int]:
        """Hold the shared blocks, allocate ``fresh`` ones, copy the donor's positions into the first of them."""
        for b in reuse.shared:
            self.blocks.hold(b)
        if reuse.copy:
            self.blocks.hold(reuse.donor)  # pinned: the allocations below never evict it
        table = reuse.shared + [self.blocks.allocate() for _ in range(fresh)]
        if reuse.copy:
            self.copy_block(reuse.donor, table[len(reuse.shared)], reuse.copy)
            self.blocks.release(reuse.donor)
        return table

    def _start(self, seq: Sequence, table: list[int], reused: int) -> None:
        seq.block_table = table
        seq.num_cached = reused
        seq.status = SequenceStatus.RUNNING
        seq.kv_epoch = self.weight_epoch
        n = 0
        while n < len(table) and self.blocks.node[table[n]] is not None:
            n += 1
        seq.num_registered = n
        self.running.append(seq)

    def _register(self, seq: Sequence, upto: int, ready: bool, switch: bool) -> None:
        """Register ``seq``'s full blocks up to ``upto``. Where the tree already holds a block's content in another
        block, ``switch`` makes ``seq`` share that one (its own is released); otherwise registration stops there."""
        bs = self.block_size
        while seq.num_registered < upto:
            j = seq.num_registered
            b = seq.block_table[j]
            canon = self.blocks.register(
                seq.block_table[j - 1] if j else None, b, seq.token_ids[j * bs : (j + 1) * bs], ready
            )
            if canon is None or (canon != b and not switch):
                return
            if canon != b:
                self.blocks.hold(canon)
                seq.block_table[j] = canon
                self.blocks.release(b)
            seq.num_registered += 1

    # ----------------------------------------------------------------- decode
    def schedule_decode(self) -> tuple[list[Sequence], list[SharedPrefix]]:
        """Give every running sequence the block its next K/V goes to, preempting the youngest when none is left.

        Returns the decode batch (rows that share prefix blocks next to each other) and those groups."""
        for seq in sorted(self.running, key=lambda s: s.seq_id):
            if seq.status != SequenceStatus.RUNNING:
                continue
            if (len(seq.token_ids) - 1) // self.block_size < len(seq.block_table):
                continue
            while self.blocks.capacity() == 0:
                victim = max(self.running, key=lambda s: s.seq_id)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                seq.block_table.append(self.blocks.allocate())
        return self.decode_batch()

    def decode_batch(self) -> tuple[list[Sequence], list[SharedPrefix]]:
        """The running sequences in decode order and the groups among them that hold the same prefix blocks.

        A row's shared depth is the number of its leading blocks that another running row holds too (a
        prefix of its table: holders hold whole chains); rows whose deepest shared block is the same form
        a group over ``depth x block_size`` positions (a GRPO group over its prompt's full blocks)."""
        ref = self.blocks.ref
        groups: dict[int, list[Sequence]] = {}
        alone: list[Sequence] = []
        depth_of: dict[int, int] = {}
        for seq in sorted(self.running, key=lambda s: s.seq_id):
            table = seq.block_table
            lo, hi = 0, len(table)
            while lo < hi:  # the first block held by this row alone
                mid = (lo + hi) // 2
                if ref[table[mid]] >= 2:
                    lo = mid + 1
                else:
                    hi = mid
            if lo:
                groups.setdefault(table[lo - 1], []).append(seq)
                depth_of[seq.seq_id] = lo
            else:
                alone.append(seq)
        order: list[Sequence] = []
        shared: list[SharedPrefix] = []
        for members in groups.values():
            if len(members) > 1:
                shared.append(
                    SharedPrefix(
                        list(range(len(order), len(order) + len(members))),
                        depth_of[members[0].seq_id] * self.block_size,
                    )
                )
            order += members
        return order + alone, shared

    def preempt(self, seq: Sequence) -> None:
        """Back to the front of the waiting queue without blocks; tokens, logprobs and generator kept.

        Its blocks are registered first (the partial last one too), so what is still cached when it is
        admitted again is shared or copied back bit for bit rather than recomputed."""
        self.running.remove(seq)
        self._keep_reusable(seq)
        for b in reversed(seq.block_table):
            self.blocks.release(b)
        seq.block_table, seq.num_cached, seq.num_registered = [], 0, 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def after_step(self) -> None:
        """Register the blocks that running sequences filled in this step (their K/V is final)."""
        if not self.prefix_caching:
            return
        for seq in self.running:
            if seq.kv_epoch == self.weight_epoch and seq.num_registered < seq.num_cached // self.block_size:
                self._register(seq, seq.num_cached // self.block_size, ready=True, switch=True)

    # ----------------------------------------------------------------- release
    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished; its blocks are registered (cached), parked for its session, then released."""
        seq.finish_reason = reason
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            n = seq.num_cached
            fresh = self._keep_reusable(seq)
            if fresh and seq.session_id is not None and reason != "abort":
                self.blocks.park(seq.session_id, seq.block_table[: self.blocks_needed(n)], seq.token_ids[:n])
            for b in reversed(seq.block_table):
                self.blocks.release(b)
            seq.block_table = []
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _keep_reusable(self, seq: Sequence) -> bool:
        """Register every block of a sequence that stops running (the partial last one too) when its K/V is of the
        live weights; returns whether it is."""
        n, bs = seq.num_cached, self.block_size
        fresh = n > 0 and seq.kv_epoch == self.weight_epoch
        if fresh and self.prefix_caching:
            self._register(seq, n // bs, ready=True, switch=True)
            if n % bs and seq.num_registered == n // bs:
                self._register_last(seq)
        return fresh

    def _register_last(self, seq: Sequence) -> None:
        """Register the partial last block of a sequence that stops running (a later turn copies from it)."""
        j, bs = seq.num_registered, self.block_size
        b = seq.block_table[j]
        canon = self.blocks.register(
            seq.block_table[j - 1] if j else None, b, seq.token_ids[j * bs : seq.num_cached], True
        )
        if canon is not None and canon != b:
            self.blocks.hold(canon)
            seq.block_table[j] = canon
            self.blocks.release(b)

    def weights_changed(self) -> int:
        """New live weights: nothing cached or parked is reusable any more. Returns the sessions dropped.

        Running sequences keep their blocks (unregistered: never shared again) unless the engine
        recomputes their K/V and calls ``mark_recomputed``."""
        self.weight_epoch += 1
        dropped = len(self.blocks.parked)
        self.blocks.drop_all()
        for seq in self.running:
            seq.num_registered = 0
        return dropped

    def mark_recomputed(self, seq: Sequence) -> None:
        """``seq``'s K/V was recomputed under the live weights: its blocks are shareable again."""
        seq.kv_epoch = self.weight_epoch
        if self.prefix_caching:
            self._register(seq, seq.num_cached // self.block_size, ready=True, switch=True)
