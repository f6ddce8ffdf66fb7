"""Orchestrator: many agent-environment episodes at once, grouped by prompt, for users who drive rollouts.

    orch = Orchestrator(engine, agent_factory, env_factory, group_size=4, max_concurrency=32)
    async for group in orch.run(rows):           # groups in the order they fill
        train_on(group.episodes)
        async with orch.gate.pausing(drain=True):  # no new episode starts, running ones finish
            await push_weights(...)

Each row is rolled out ``group_size`` times; finished episodes are bucketed by
``group_key(row)`` (default: the row's position) and a group is yielded as soon as it holds
``group_size`` results. At most ``max_open_groups`` rows have episodes in flight or waiting for
their group (bounds memory); at most ``max_concurrency`` episodes run at once. An episode that
raises, or runs past ``episode_timeout_s`` (it is cancelled), is counted in ``group.errors``
(its group is yielded with the episodes that finished), so a hung episode never blocks its group.
``group.stop_reasons()`` counts why the group's episodes ended (``timeout`` / ``error`` for those).
Every episode passes ``orch.gate`` (``training/utils/aio/pause_gate.py``: counted pausers, drain).

With ``training.recipes.async_rl_loop`` use ``make_agent_rollout_fn`` instead: the recipe
already fans out, groups, gates and syncs weights.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Hashable, Iterable, Optional

from training.agents.rollout_fn import AgentFactory, EnvFactory
from training.agents.trajectory import Episode, TrajectoryEngine
from training.utils.aio.pause_gate import PauseGate


@dataclass
class TrajectoryGroup:
    """Finished episodes of one group key."""

    key: Hashable
    row: dict
    episodes: list[Episode] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """``Type: message`` of each episode that raised."""

    def stop_reasons(self) -> dict[str, int]:
        """Episodes per stop reason: each finished one's ``Episode.stop_reason``, ``timeout`` for one that ran
        past ``episode_timeout_s``, ``error`` for one that raised (or was cancelled)."""
        counts: dict[str, int] = {}
        for reason in [e.stop_reason for e in self.episodes] + [
            "timeout" if err.startswith("TimeoutError") else "error" for err in self.errors
        ]:
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    def results(self, as_run: bool = True) -> list[Any]:
        """The episodes as rollout results (``RolloutRun`` / ``RolloutSample``), skipping empty ones."""
        return [r for r in (e.to_result(as_run) for e in self.episodes) if r is not None]


class Orchestrator:
    """Runs ``group_size`` episodes per row with bounded concurrency and yields full groups."""

    def __init__(
        self,
        engine: TrajectoryEngine,
        agent_factory: AgentFactory,
        env_factory: EnvFactory,
        *,
        group_size: int = 4,
        max_concurrency: int = 32,
        max_open_groups: int = 16,
        group_key: Optional[Callable[[dict], Hashable]] = None,
        episode_timeout_s: Optional[float] = None,
    ):
        for name, value in (
            ("group_size", group_size),
            ("max_concurrency", max_concurrency),
            ("max_open_groups", max_open_groups),
        ):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if episode_timeout_s is not None and not episode_timeout_s > 0:
            raise ValueError(f"episode_timeout_s: must be > 0 or None, got {episode_timeout_s}")
        self.episode_timeout_s = episode_timeout_s
        """Deadline of one episode (sampling and tools); None = no deadline."""
        self.engine = engine
        self.agent_factory = agent_factory
        self.env_factory = env_factory
        self.group_size = group_size
        self.max_concurrency = max_concurrency
        self.max_open_groups = max_open_groups
        self.group_key = group_key
        self.gate = PauseGate()
        """Episodes start only while it is open; pause it around a weight sync (``pausing(drain=True)``)."""
        self.peak_open_groups = 0
        self.peak_running = 0
        self._running = 0

    async def _episode(self, row: dict, sem: asyncio.Semaphore) -> Episode:
        async with sem:
            async with self.gate.admitted():
                self._running += 1
                self.peak_running = max(self.peak_running, self._running)
                try:
                    episode = self.engine.collect(self.agent_factory(row), self.env_factory(row))
                    try:
                        return await asyncio.wait_for(episode, self.episode_timeout_s)
                    except asyncio.TimeoutError:
                        raise asyncio.TimeoutError(
                            f"episode ran past episode_timeout_s={self.episode_timeout_s}"
                        ) from None
                finally:
                    self._running -= 1

    async def run(self, rows: Iterable[dict]) -> AsyncIterator[TrajectoryGroup]:
        """Yield each group as soon as it has ``group_size`` finished (or failed) episodes."""
        sem = asyncio.Semaphore(self.max_concurrency)
        slots = asyncio.Semaphore(self.max_open_groups)
        ready: asyncio.Queue = asyncio.Queue()
        open_groups: dict[Hashable, TrajectoryGroup] = {}
        tasks: set[asyncio.Task] = set()
        done_marker = object()

        def on_done(task: asyncio.Task, key: Hashable) -> None:
            tasks.discard(task)
            group = open_groups[key]
            if task.cancelled():
                group.errors.append("CancelledError: episode cancelled")
            elif task.exception() is not None:
                e = task.exception()
                group.errors.append(f"{type(e).__name__}: {e}")
            else:
                group.episodes.append(task.result())
            if len(group.episodes) + len(group.errors) == self.group_size:
                del open_groups[key]
                slots.release()
                ready.put_nowait(group)

        async def produce() -> None:
            for i, row in enumerate(rows):
                await slots.acquire()
                key = self.group_key(row) if self.group_key else i
                if key in open_groups:
                    raise ValueError(f"group_key: {key!r} is already open; keys must be unique among open groups")
                open_groups[key] = TrajectoryGroup(key=key, row=row)
                self.peak_open_groups = max(self.peak_open_groups, len(open_groups))
                for _ in range(self.group_size):
                    t = asyncio.create_task(self._episode(row, sem))
                    tasks.add(t)
                    t.add_done_callback(lambda t, k=key: on_done(t, k))

        producer = asyncio.create_task(produce())
        producer.add_done_callback(lambda _: ready.put_nowait(done_marker))
        finished_producing = False
        try:
            while True:
                if finished_producing and not open_groups and ready.empty():
                    break
                item = await ready.get()
                if item is done_marker:
                    finished_producing = True
                    if producer.exception() is not None:
                        raise producer.exception()
                    continue
                yield item
        finally:
            producer.cancel()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(producer, *tasks, return_exceptions=True)
