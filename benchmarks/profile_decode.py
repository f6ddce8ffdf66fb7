"""Profile one decode step of the embedded engine's lean forward (``torch.profiler``, CPU).

    python -m benchmarks.profile_decode [--model smollm2] [--batch 32] [--context 160] [--steps 20] [--dtype bfloat16]

Fills ``--batch`` slots with ``--context`` positions of K/V (random prompts, prefilled), then
profiles ``--steps`` decode steps plus their sampling and prints the op table sorted by self CPU
time. What this showed is written in training/deployment/engine/README.md ("Where a decode step
goes"). A diagnosis tool, not a figure: it emits no JSON line and run_all does not run it.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import AutoConfig

from benchmarks.common import model_path
from training.deployment.engine.config import SamplingParams
from training.deployment.engine.model_runner import LeanModelRunner, PrefillItem
from training.deployment.engine.sampling import sample
from training.deployment.engine.sequence import Sequence


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    path = model_path(a.model)
    config = AutoConfig.from_pretrained(path)
    runner = LeanModelRunner(
        path, config, a.batch, a.context + a.steps + 8, getattr(torch, a.dtype), torch.device("cpu")
    )
    rng = random.Random(0)
    for s in range(a.batch):
        runner.prefill([PrefillItem(s, [rng.randrange(3, 500) for _ in range(a.context)], 0)])
    slots, tokens = list(range(a.batch)), [rng.randrange(3, 500) for _ in range(a.batch)]
    params = SamplingParams(max_tokens=a.steps + 8, temperature=1.0)
    seqs = [Sequence([1] * a.context, params, torch.Generator().manual_seed(i), frozenset()) for i in range(a.batch)]

    def step(i: int) -> None:
        logits = runner.decode(slots, tokens, [a.context + i] * a.batch)
        sample(logits, seqs)

    for i in range(3):
        step(i)
    t0 = time.perf_counter()
    for i in range(a.steps):
        step(i)
    per_step = (time.perf_counter() - t0) / a.steps
    print(
        f"unprofiled: {per_step * 1e3:.1f} ms/step, {a.batch / per_step:.0f} tok/s (batch {a.batch}, "
        f"context {a.context}, {a.dtype}, {torch.get_num_threads()} threads)"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(a.steps):
            step(i)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
