"""Orchestrator: bounded concurrency, grouping, open-group cap, failures, and the pause gate around a weight sync.

The engine here is a stand-in that sleeps per episode (the orchestrator only schedules; the
real engine against the server is covered in test_agents_trajectory.py).
"""

import asyncio

import pytest

from training.agents import Orchestrator
from training.agents.trajectory import Episode
from training.utils.aio.pause_gate import PauseGate
from training.utils.rl.rollout import RolloutSample


class SleepyEngine:
    """``collect`` sleeps ``row['delay']`` seconds and returns a one-segment episode; rows with 'fail' raise."""

    def __init__(self):
        self.running = 0
        self.peak = 0
        self.started = []

    async def collect(self, agent, env):
        row = agent
        self.started.append(row["id"])
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(row.get("delay", 0.01))
            if row.get("fail"):
                raise RuntimeError(f"agent crashed on row {row['id']}")
            seg = RolloutSample(tokens=[1, 2], logprobs=[0.0, -0.5], loss_mask=[0, 1], reward=float(row["id"]))
            return Episode(segments=[seg], reward=float(row["id"]), finish_reason="stop")
        finally:
            self.running -= 1


def orchestrator(engine, **kw):
    return Orchestrator(engine, agent_factory=lambda row: row, env_factory=lambda row: None, **kw)


def test_groups_fill_with_bounded_concurrency_and_open_groups():
    engine = SleepyEngine()
    rows = [{"id": i, "delay": 0.5 if i == 0 else 0.01} for i in range(8)]  # wide gap: robust on a busy machine
    orch = orchestrator(engine, group_size=3, max_concurrency=4, max_open_groups=2)

    async def go():
        return [g async for g in orch.run(rows)]

    groups = asyncio.run(go())
    assert sorted(g.key for g in groups) == list(range(8))
    assert groups[0].key != 0  # yielded as they fill: the slow row 0 is not first
    assert all(len(g.episodes) == 3 and g.errors == [] for g in groups)
    assert all(ep.reward == g.row["id"] for g in groups for ep in g.episodes)
    assert engine.peak <= 4 and orch.peak_running <= 4 and orch.peak_open_groups <= 2
    assert [type(r).__name__ for r in groups[0].results()] == ["RolloutRun"] * 3


def test_failed_episodes_are_counted_in_their_group():
    rows = [{"id": 0}, {"id": 1, "fail": True}]

    async def go():
        return {g.key: g async for g in orchestrator(SleepyEngine(), group_size=2).run(rows)}

    groups = asyncio.run(go())
    assert len(groups[0].episodes) == 2 and groups[0].errors == []
    assert groups[1].episodes == [] and groups[1].errors == ["RuntimeError: agent crashed on row 1"] * 2


def test_group_key_must_be_unique_among_open_groups():
    async def go():
        return [
            g
            async for g in orchestrator(
                SleepyEngine(), group_size=1, group_key=lambda r: "same", max_open_groups=4
            ).run([{"id": 0, "delay": 0.2}, {"id": 1}])
        ]

    with pytest.raises(ValueError, match="group_key"):
        asyncio.run(go())
    with pytest.raises(ValueError, match="group_size"):
        orchestrator(SleepyEngine(), group_size=0)


def test_gate_pauses_new_episodes_and_drains_running_ones():
    async def go():
        gate = PauseGate()
        log = []

        async def episode(name, hold):
            async with gate.admitted():
                log.append(f"start {name}")
                await asyncio.sleep(hold)
                log.append(f"end {name}")

        first = asyncio.create_task(episode("a", 0.1))
        await asyncio.sleep(0.01)
        async with gate.pausing(drain=True):
            log.append("sync")  # only after "a" ended
            late = asyncio.create_task(episode("b", 0.0))
            await asyncio.sleep(0.05)
            assert gate.paused and "start b" not in log
            log.append("sync done")
        await asyncio.gather(first, late)
        return log

    assert asyncio.run(go()) == ["start a", "end a", "sync", "sync done", "start b", "end b"]


def test_orchestrator_waits_while_weights_sync():
    engine = SleepyEngine()
    orch = orchestrator(engine, group_size=1, max_concurrency=8)

    async def go():
        async with orch.gate.pausing():
            it = orch.run([{"id": i} for i in range(3)])
            task = asyncio.ensure_future(it.__anext__())
            await asyncio.sleep(0.05)
            assert engine.started == []  # nothing starts during the sync
        first = await task
        rest = [g async for g in it]
        return [first] + rest

    assert sorted(g.key for g in asyncio.run(go())) == [0, 1, 2]


def test_hung_episode_times_out_and_its_group_is_still_yielded():
    engine = SleepyEngine()
    rows = [{"id": 0, "delay": 3600.0}, {"id": 1}]  # row 0 hangs (an hour): without a deadline its group never fills
    orch = orchestrator(engine, group_size=2, max_concurrency=4, episode_timeout_s=0.2)

    async def go():
        return await asyncio.wait_for(_collect(orch.run(rows)), 10)

    groups = {g.key: g for g in asyncio.run(go())}
    assert groups[0].episodes == [] and len(groups[0].errors) == 2
    assert all(e.startswith("TimeoutError: episode ran past episode_timeout_s=0.2") for e in groups[0].errors)
    assert len(groups[1].episodes) == 2 and engine.running == 0  # the hung episodes were cancelled
    with pytest.raises(ValueError, match="episode_timeout_s"):
        orchestrator(engine, episode_timeout_s=0)


async def _collect(aiter):
    return [x async for x in aiter]


def test_group_stop_reasons_count_timeouts_and_errors():
    """Finished episodes give their own stop reason; a hung one counts as ``timeout``, a raising one as ``error``."""
    engine = SleepyEngine()
    rows = [{"id": 0, "delay": 3600.0}, {"id": 1}, {"id": 2, "fail": True}]
    orch = orchestrator(engine, group_size=2, max_concurrency=6, episode_timeout_s=0.2)

    async def go():
        return await asyncio.wait_for(_collect(orch.run(rows)), 10)

    groups = {g.key: g for g in asyncio.run(go())}
    assert groups[0].stop_reasons() == {"timeout": 2}
    assert groups[1].stop_reasons() == {"finish": 2}
    assert groups[2].stop_reasons() == {"error": 2}
