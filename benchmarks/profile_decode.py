"""Profile decode steps of the embedded engine's lean forward on CPU: where a step's time goes.

    python -m benchmarks.profile_decode [--model smollm2] [--kernel native|torch] [--batch 32] [--context 160]
        [--group 0] [--steps 20] [--dtype bfloat16] [--block-size 16]
    python -m benchmarks.profile_decode --compare [--batches 8 32 64] [--context 160] [--steps 5] [--rounds 3]

Fills ``--batch`` rows with ``--context`` positions of K/V in KV blocks of ``--block-size`` tokens (random
prompts, prefilled; each row's blocks scattered over the pool as a busy engine hands them out; with
``--group G`` the rows come in groups of G that share their prompt's full blocks and copy its partial
last one, as a GRPO group's members do),
then times ``--steps`` decode steps plus their sampling. ``--kernel native`` (the default on CPU in
fp32) runs the C step of native.py built with its phase timers and prints the milliseconds per
step of each phase, the matmul phases' GFLOP/s as a share of this machine's attainable GEMM rate and
attention's K/V read rate as a share of its memory bandwidth (both measured as ``decode_roofline`` does);
``--kernel torch`` prints the ``torch.profiler`` op table of the torch step.

``--compare`` times the decode kernels against each other instead, in one process, interleaved round by round
(median of ``--rounds``): the fp32 C and torch steps, the bf16 C step (its default build: AMX tiles where the
CPU has them; and its widening and ``vdpbf16ps`` builds), the bf16 torch step; ms per forward step (no sampling) at each of
``--batches``, and the bf16 steps' max / mean |Δ logprob| against the fp32 C step over ``--steps`` tokens
sampled from the fp32 step (T = 1) and fed to every runner. Each time is wall clock and, in brackets, the
process's CPU time (at ``OMP_NUM_THREADS=1`` the figure other jobs on a shared machine disturb least).

What this showed is written in training/deployment/engine/README.md. A diagnosis tool, not a
figure: it emits no JSON line and run_all does not run it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoConfig

from benchmarks.common import model_path
from benchmarks.decode_roofline import bandwidth_gbs, gemm_gflops, gemm_shapes, phase_cost
from training.deployment.engine.kv_cache import KVBudget
from training.deployment.engine.requests import SamplingParams
from training.deployment.engine.runners.lean import LeanModelRunner, PrefillItem, SharedPrefix
from training.utils.config import EngineConfig
from training.deployment.engine.token_sampler import sample
from training.deployment.engine.sequence import Sequence


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kernel", default="native", choices=["native", "torch"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--group", type=int, default=0, help="rows per group sharing a prompt (0: every row its own)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=EngineConfig.kv_block_size, help="tokens per KV block")
    p.add_argument("--compare", action="store_true", help="time fp32 C, bf16 C and bf16 torch steps interleaved")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64], help="batch sizes of --compare")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of --compare (median reported)")
    a = p.parse_args()
    if a.compare:
        compare(a)
        return
    path = model_path(a.model)
    config = AutoConfig.from_pretrained(path)
    dtype, native = getattr(torch, a.dtype), a.kernel == "native"
    max_len, bs = a.context + a.steps + 8, a.block_size
    per_row = -(-max_len // bs)
    budget = KVBudget(block_size=bs, num_blocks=a.batch * per_row)
    runner = LeanModelRunner(path, config, budget, max_len, dtype, torch.device("cpu"), native=False)
    if native:
        from training.deployment.engine.runners.native import NativeDecoder

        runner.native = NativeDecoder(runner, profile=True)
    rng = random.Random(0)
    order = list(range(budget.num_blocks))
    rng.shuffle(order)
    for b in order:
        runner.cache.zero_block(b)
    tables = [order[r * per_row : (r + 1) * per_row] for r in range(a.batch)]
    groups = []
    if a.group > 1:
        full, part = divmod(a.context, bs)
        for first in range(0, a.batch, a.group):
            rows = list(range(first, min(first + a.group, a.batch)))
            runner.prefill([PrefillItem(tables[first], [rng.randrange(3, 500) for _ in range(a.context)], 0)])
            for r in rows[1:]:
                tables[r][:full] = tables[first][:full]
                runner.copy_block(tables[first][full], tables[r][full], part)
            groups.append(SharedPrefix(rows, full * bs))
    else:
        for r in range(a.batch):
            runner.prefill([PrefillItem(tables[r], [rng.randrange(3, 500) for _ in range(a.context)], 0)])
    tokens = [rng.randrange(3, 500) for _ in range(a.batch)]
    params = SamplingParams(max_tokens=a.steps + 8, temperature=1.0)
    seqs = [Sequence([1] * a.context, params, torch.Generator().manual_seed(i), frozenset()) for i in range(a.batch)]
    sampling = [0.0]

    def step(i: int) -> None:
        logits = runner.decode(tables, tokens, [a.context + i] * a.batch, groups)
        t0 = time.perf_counter()
        sample(logits, seqs, native)
        sampling[0] += time.perf_counter() - t0

    for i in range(3):
        step(i)
    if native:
        runner.native.phase_seconds(reset=True)
    sampling[0] = 0.0
    t0 = time.perf_counter()
    for i in range(a.steps):
        step(i)
    per_step = (time.perf_counter() - t0) / a.steps
    print(
        f"{a.kernel} step: {per_step * 1e3:.1f} ms/step, {a.batch / per_step:.0f} tok/s (batch {a.batch}, "
        f"context {a.context}, groups of {a.group or 1}, blocks of {bs}, {a.dtype}, {torch.get_num_threads()} threads)"
    )
    if native:
        phases = {**runner.native.phase_seconds(), "sampling (C)": sampling[0]}
        print_phases(phases, a.steps, per_step, config, a.batch, a.context + a.steps // 2, dtype)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(a.steps):
            step(i)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=a.rows))


def print_phases(phases: dict, steps: int, per_step: float, config, rows: int, keys: int, dtype: torch.dtype) -> None:
    """The phase table, with the matmul phases' GFLOP/s against this machine's attainable GEMM rate and
    attention's K/V bytes per second against its copy bandwidth (both as ``decode_roofline`` measures them)."""
    cost = phase_cost(config, rows, keys, dtype)
    shapes = gemm_shapes(config)
    gemm = max(gemm_gflops(dtype, shapes, 3).values())
    bandwidth = bandwidth_gbs(3)
    print(f"roofs: {dtype} GEMM {gemm:.0f} GFLOP/s (best torch.mm of {shapes}), memory {bandwidth:.1f} GB/s (copy)")
    print("| phase | ms / step | share | achieved | of the roof |\n| --- | --- | --- | --- | --- |")
    for name, seconds in phases.items():
        s = seconds / steps
        line = f"| {name} | {s * 1e3:.1f} | {s / per_step:.0%} |"
        if name in cost and s > 0:
            flops, nbytes = cost[name]
            if name == "attention":  # bound by reading the K/V
                line += f" {nbytes / s / 1e9:.1f} GB/s | {nbytes / s / 1e9 / bandwidth:.0%} of bandwidth |"
            else:
                line += f" {flops / s / 1e9:.0f} GFLOP/s | {flops / s / 1e9 / gemm:.0%} of GEMM |"
        else:
            line += " | |"
        print(line)


def _filled_runner(path: str, config, dtype: torch.dtype, native: bool, rows: int, context: int, max_len: int, bs: int):
    """A runner whose ``rows`` rows hold ``context`` positions of the same random prompts (seed 0) in scattered blocks."""
    per_row = -(-max_len // bs)
    budget = KVBudget(block_size=bs, num_blocks=rows * per_row)
    runner = LeanModelRunner(path, config, budget, max_len, dtype, torch.device("cpu"), native=native)
    rng = random.Random(0)
    order = list(range(budget.num_blocks))
    rng.shuffle(order)
    for b in order:
        runner.cache.zero_block(b)
    tables = [order[r * per_row : (r + 1) * per_row] for r in range(rows)]
    for r in range(rows):
        runner.prefill([PrefillItem(tables[r], [rng.randrange(3, 500) for _ in range(context)], 0)])
    return runner, tables


def compare(a) -> None:
    """``--compare``: fp32 C and torch, bf16 C (both builds) and torch; ms per step and |Δ logprob| vs fp32 C."""
    from training.deployment.engine.runners.native import NativeDecoder

    path = model_path(a.model)
    config = AutoConfig.from_pretrained(path)
    rows, max_len = max(a.batches), a.context + a.steps + 8
    f32, tables = _filled_runner(path, config, torch.float32, True, rows, a.context, max_len, a.block_size)
    b16, _ = _filled_runner(path, config, torch.bfloat16, True, rows, a.context, max_len, a.block_size)
    b16_torch, _ = _filled_runner(path, config, torch.bfloat16, False, rows, a.context, max_len, a.block_size)
    variants = {  # name: (runner, its native decoder or None for the torch step)
        "fp32 C": (f32, f32.native),
        "fp32 torch": (f32, None),
        "bf16 C": (b16, b16.native),
        "bf16 C widen": (b16, NativeDecoder(b16, matmuls="widen")),
        "bf16 C vdpbf16ps": (b16, NativeDecoder(b16, matmuls="vdpbf16ps")),
        "bf16 torch": (b16_torch, None),
    }
    print(
        f"compare: {a.model}, context {a.context}, {torch.get_num_threads()} threads, rounds {a.rounds}; "
        "ms per step, wall (process CPU time: on a shared machine the steadier figure at 1 thread)"
    )
    print(f"| batch | {' | '.join(variants)} | max / mean abs dlogprob vs fp32 C: bf16 C | bf16 torch |")
    print("| --- " * (len(variants) + 3) + "|")
    for batch in a.batches:
        tb, pos = tables[:batch], [a.context] * batch
        gen = torch.Generator().manual_seed(batch)
        tokens, steps = [random.Random(batch).randrange(3, 500) for _ in range(batch)], []
        gaps = {"c": [], "torch": []}
        f32.native, b16.native = variants["fp32 C"][1], variants["bf16 C"][1]
        for i in range(a.steps):  # sampled from fp32 at T = 1, fed to all three
            p = [x + i for x in pos]
            ref = torch.log_softmax(f32.decode(tb, tokens, p), -1)
            got = {"c": b16.decode(tb, tokens, p), "torch": b16_torch.decode(tb, tokens, p)}
            steps.append((tokens, p))
            tokens = torch.multinomial(ref.exp(), 1, generator=gen)[:, 0]
            for name, logits in got.items():
                lp = torch.log_softmax(logits.float(), -1)
                gaps[name].append((lp.gather(1, tokens[:, None]) - ref.gather(1, tokens[:, None])).abs()[:, 0])
            tokens = tokens.tolist()
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for _ in range(a.rounds):
            for name, (runner, decoder) in variants.items():
                runner.native = decoder
                t0, c0 = time.perf_counter(), time.process_time()
                for t, p in steps:
                    runner.decode(tb, t, p)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                times[name].append((wall / len(steps) * 1e3, cpu / len(steps) * 1e3))
        ms = {name: [statistics.median(x) for x in zip(*v)] for name, v in times.items()}
        gap = {name: torch.cat(v) for name, v in gaps.items()}
        print(
            f"| {batch} | "
            + " | ".join(f"{ms[n][0]:.1f} ({ms[n][1]:.1f})" for n in variants)
            + " | "
            + " | ".join(f"{g.max():.2e} / {g.mean():.2e}" for g in gap.values())
            + " |"
        )


if __name__ == "__main__":
    main()
