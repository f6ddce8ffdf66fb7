"""Block manager: which KV block holds what, who holds it, what is shared and what is evicted.

Every block of the pool (``kv_cache.py``) is in exactly one state:

- USED: held by at least one running sequence (``ref[b]`` of them; a block shared by a GRPO group's
  members is held once per member and stored once).
- PARKED: held by no running sequence but by one or more parked sessions (``pins[b]``): the finished
  turn of a session (``x-multi-turn-session-id``), kept for its next turn.
- CACHED: held by nobody, its content registered in the prefix tree: reusable until evicted.
- FREE: nothing.

Prefix tree (exact, no hashes): a node is a block whose K/V is reusable, with the tokens it holds K/V for
(``block_size`` of them for a full block, fewer for a partial one: the last block of a finished
sequence) and its parent, the node of the block before it. A path from the root is a prefix; a full
node's children are keyed by their tokens, so ``match`` walks a prompt block by block with one dict
lookup each, and two prefixes equal as token lists reach the same nodes. Only full nodes are shared in
place; a partial match (a partial node, a full node the prompt leaves mid-block, a running sequence's
last block) is copied into a block of the new sequence. A node is *ready* once its K/V is computed: a
node registered at admission is pending until that step's prefill (``mark_ready``); pending nodes may be
shared (the prefill writes every item's K/V of a layer before any item attends in it) but never copied.

Invariant: whoever holds a registered block holds its ancestors too (a running sequence holds its
whole block table; a parked session its whole turn). So a node held by nobody has only such
descendants, and evicting it evicts its subtree. Release order makes leaves older than their
ancestors in the LRU, so a chain is evicted from its end.

Eviction when a block is needed and none is free: the least recently used CACHED block (with its
subtree), then the least recently parked session (its blocks become CACHED, and so on). USED blocks are
never evicted: the scheduler preempts a running sequence instead (scheduler.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional


class PrefixNode:
    """A block whose K/V is reusable: the ``tokens`` it holds K/V for, after the prefix of ``parent``."""

    __slots__ = ("block", "parent", "tokens", "children", "by_first", "ready")

    def __init__(self, block: int, parent: Optional["PrefixNode"], tokens: tuple[int, ...], ready: bool):
        self.block = block
        self.parent = parent
        self.tokens = tokens
        self.children: dict[tuple[int, ...], PrefixNode] = {}
        """Full child blocks by their tokens."""
        self.by_first: dict[int, list[PrefixNode]] = {}
        """Every child (full or partial) by its first token: where a partial match is looked for."""
        self.ready = ready


@dataclass
class ParkedTurn:
    """A session's finished turn: ``blocks`` hold K/V of ``tokens`` (positions ``[0, len(tokens))``)."""

    blocks: list[int]
    tokens: list[int]


class BlockManager:
    """Reference counts, the free list, the LRU of cached blocks, the prefix tree and the parked sessions.

    Verbs (nano-vllm's, at block level; the scheduler applies them to sequences): ``capacity`` (blocks a
    running sequence could still get), ``allocate`` (a block of one's own, evicting if needed),
    ``hold`` / ``release`` (share / let go of a block), ``match`` / ``tail_candidates`` (prefix lookup),
    ``register`` (make a block's content reusable), ``park`` / ``unpark`` (a session's turn).
    """

    def __init__(self, num_blocks: int, block_size: int, hand_out: Callable[[int], None]):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.hand_out = hand_out
        """Called on every block handed out by ``allocate`` (``KVCache.hand_out``: zeroes it where attention needs that)."""
        self.ref = [0] * num_blocks
        self.pins = [0] * num_blocks
        self.node: list[Optional[PrefixNode]] = [None] * num_blocks
        self.used = 0
        """Blocks with ``ref > 0``."""
        self.root = PrefixNode(-1, None, (), True)
        self.parked: OrderedDict[str, ParkedTurn] = OrderedDict()
        """Session id → its parked turn, least recently parked first."""
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._free: list[int] = []
        self.evicted = 0
        """Cached blocks evicted so far (a test counts them)."""
        self.reset()

    def reset(self) -> None:
        """Every block free, lowest index handed out first (only when nothing is held: after a wake)."""
        assert self.used == 0 and not self.parked, "reset with blocks held"
        self.drop_all()
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: freed blocks (resident) are reused first
        self._lru.clear()

    # ------------------------------------------------------------------ accounting
    def capacity(self) -> int:
        """Blocks not held by a running sequence (free, cached or parked: all can be reclaimed)."""
        return self.num_blocks - self.used

    def stats(self) -> dict[str, int]:
        """``blocks_used`` (running), ``blocks_cached`` (parked or cached: reusable), ``blocks_free``, ``blocks_total``."""
        free = len(self._free)
        return {
            "blocks_used": self.used,
            "blocks_cached": self.num_blocks - self.used - free,
            "blocks_free": free,
            "blocks_total": self.num_blocks,
        }

    # ------------------------------------------------------------------ holding
    def allocate(self) -> int:
        """A block held once (``ref = 1``), handed out (``hand_out``): a free one, else the LRU cached one (its subtree evicted with it),
        else one a parked session gives up. The caller checks ``capacity() > 0`` first."""
        while not self._free:
            if self._lru:
                self.evicted += 1
                self._forget(self.node[next(iter(self._lru))])
            elif self.parked:
                self.unpark(next(iter(self.parked)))
            else:
                raise RuntimeError("no KV block left to allocate (the scheduler checks capacity first)")
        b = self._free.pop()
        self.ref[b] = 1
        self.used += 1
        self.hand_out(b)
        return b

    def hold(self, b: int) -> None:
        """One more running holder of ``b`` (a shared prefix block, or a donor while it is copied)."""
        if self.ref[b] == 0:
            self.used += 1
            self._lru.pop(b, None)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        """One running holder fewer; a block nobody holds becomes PARKED, CACHED (most recent) or FREE."""
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.used -= 1
            self._settle(b)

    def _settle(self, b: int) -> None:
        if self.pins[b]:
            return
        if self.node[b] is not None:
            self._lru[b] = None
            self._lru.move_to_end(b)
        else:
            self._free.append(b)

    # ------------------------------------------------------------------ prefix tree
    def match(self, tokens: list[int], limit: int) -> list[int]:
        """Blocks of the longest chain of full nodes (ready or pending) holding ``tokens[:limit]``'s first blocks."""
        bs, node, out = self.block_size, self.root, []
        for start in range(0, limit - bs + 1, bs):
            child = node.children.get(tuple(tokens[start : start + bs]))
            if child is None:
                break
            out.append(child.block)
            node = child
        return out

    def tail_candidates(self, last: Optional[int], first_token: int) -> list[PrefixNode]:
        """Ready children (full or partial) whose first token is ``first_token`` of block ``last``'s node (None: the root)."""
        node = self.root if last is None else self.node[last]
        if node is None:
            return []
        return [c for c in node.by_first.get(first_token, ()) if c.ready]

    def register(self, parent: Optional[int], block: int, tokens: list[int], ready: bool) -> Optional[int]:
        """Make ``block`` (holding K/V of ``tokens`` after block ``parent``'s prefix; None: at the start) reusable.

        Returns the block that now holds this content in the tree: ``block``, or another one that already
        did (the caller may switch to it), or None when ``parent`` is not registered (nor can this be).
        """
        node = self.root if parent is None else self.node[parent]
        if node is None:
            return None
        if self.node[block] is not None:
            return block
        key = tuple(tokens)
        if len(key) == self.block_size:
            existing = node.children.get(key)
        else:
            existing = next((c for c in node.by_first.get(key[0], ()) if c.tokens == key), None)
        if existing is not None:
            return existing.block
        child = PrefixNode(block, node, key, ready)
        if len(key) == self.block_size:
            node.children[key] = child
        node.by_first.setdefault(key[0], []).append(child)
        self.node[block] = child
        return block

    def mark_ready(self, blocks: list[int]) -> None:
        """The pending nodes of ``blocks`` have their K/V now (after the prefill that computed it)."""
        for b in blocks:
            if self.node[b] is not None:
                self.node[b].ready = True

    def forget_pending(self, blocks: list[int]) -> None:
        """Unregister the still-pending nodes of ``blocks`` (their prefill failed: their K/V was never written)."""
        for b in blocks:
            node = self.node[b]
            if node is not None and not node.ready:
                self._forget(node)

    def drop_all(self) -> None:
        """Forget every node and parked session (new weights): nothing computed so far is reusable."""
        for node in [c for group in self.root.by_first.values() for c in group]:
            self._forget(node)
        for session in list(self.parked):
            self.unpark(session)

    def _forget(self, node: PrefixNode) -> None:
        """Unregister ``node`` and its subtree; blocks that nobody holds become FREE."""
        siblings = node.parent.by_first[node.tokens[0]]
        siblings.remove(node)
        if not siblings:
            del node.parent.by_first[node.tokens[0]]
        if node.parent.children.get(node.tokens) is node:
            del node.parent.children[node.tokens]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(c for group in n.by_first.values() for c in group)
            self.node[n.block] = None
            if self._lru.pop(n.block, 0) is None:  # it was CACHED: nobody holds it
                self._free.append(n.block)

    # ------------------------------------------------------------------ sessions
    def park(self, session: str, blocks: list[int], tokens: list[int]) -> None:
        """Pin ``blocks`` (K/V of ``tokens``) for ``session``'s next turn; its previous turn is let go."""
        self.unpark(session)
        for b in blocks:
            self.pins[b] += 1
            self._lru.pop(b, None)
        self.parked[session] = ParkedTurn(list(blocks), list(tokens))

    def unpark(self, session: str) -> None:
        """Let go of ``session``'s parked turn (its blocks become CACHED when registered, else FREE)."""
        turn = self.parked.pop(session, None)
        if turn is None:
            return
        for b in reversed(turn.blocks):  # the end of the turn becomes the least recent
            self.pins[b] -= 1
            if self.pins[b] == 0 and self.ref[b] == 0:
                self._settle(b)
