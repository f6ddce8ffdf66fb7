"""The step checkpoint is written off the event loop: rollouts keep running while the DCP save writes.

Real parts: the tiny model and an AdamW optimizer with state, ``RunContext``'s own checkpoint methods and a real
DCP save into ``tmp_path``, the recipes' ``LoopWatchdog``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from types import SimpleNamespace

import torch

from training.recipes.context import RunContext
from training.utils.aio.loop_watch import LoopWatchdog


def test_a_step_checkpoint_does_not_block_the_event_loop(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
    optimizer.step()  # optimizer state to save too
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
    ctx = SimpleNamespace(
        cfg=SimpleNamespace(keep_checkpoints=2, loss=SimpleNamespace(reference_refresh_interval=0)),
        reference=None,
        log_path=tmp_path,
        trainer=SimpleNamespace(model=model, optimizer=optimizer),
        cursor=SimpleNamespace(state=lambda: {"position": 3}),
        _train_pool=pool,
        _checkpoint_s=0.0,
        checkpoint_due=lambda step: True,
    )
    ctx.checkpoint_state = lambda step: RunContext.checkpoint_state(ctx, step)
    ctx.write_checkpoint = lambda step, state: RunContext.write_checkpoint(ctx, step, state)

    async def run() -> tuple[float, int]:
        watchdog = LoopWatchdog(threshold_s=0.15, interval_s=0.03).start()
        ticks = 0

        async def rollout() -> None:  # stands for the rollouts in flight during the save
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(rollout())
        await asyncio.sleep(0.05)
        t0, before = time.monotonic(), ticks
        await RunContext.checkpoint_step(ctx, 1)
        blocked = watchdog.blocked_s_since(t0)
        during = ticks - before
        task.cancel()
        watchdog.stop()
        return blocked, during

    try:
        blocked, during = asyncio.run(run())
    finally:
        pool.shutdown()
    assert (tmp_path / "checkpoints").is_dir() and any((tmp_path / "checkpoints").iterdir())
    assert ctx._checkpoint_s > 0
    assert blocked <= 0.5 * ctx._checkpoint_s, (
        f"the loop stood still {blocked:.2f} s of a {ctx._checkpoint_s:.2f} s save"
    )
    assert during >= 2, f"the rollout ran {during} times during a {ctx._checkpoint_s:.2f} s save"  # 0 on the loop
