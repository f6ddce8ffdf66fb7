"""Async overlap: wall time per step of one fixed long-tail workload, synchronous vs O = 0, 1, 2.

    python -m benchmarks.async_overlap [--steps 8] [--quick]

The tiny model through ``training.recipes.async_rl_loop.main`` with its own embedded server per
run (fp32, CPU). Workload: 4 prompt groups × 4 completions per step; every rollout draws its
``max_tokens`` from a long-tail list (most 4–16 tokens, a few 128–192) with ``ignore_eos`` so the
length is exact; the draw depends only on (row, completion index), so every run gets the same
lengths. Runs: ``synchronous_training=True`` (the baseline), then
``max_head_offpolicy_versions`` = 0, 1, 2 with overlap. Figure: median ``perf/step_time_s``
over the steps after the first (from metrics.jsonl); ratio = run / synchronous (below 1 is
faster); also the median ``perf/overlap_fraction``. With ``--repeats`` > 1 a figure is the median
of the per-run medians.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import defaultdict

from benchmarks.common import base_parser, emit, median, model_path, row

LONG_TAIL = [4, 4, 4, 6, 8, 8, 8, 12, 16, 16, 24, 32, 64, 128, 192]


def make_rollout_fn_factory(seed: int = 0):
    """A rollout factory with a fixed long-tail length per (row, completion index)."""
    from training.utils.rl.rollout import RolloutSample

    def factory(setup):
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)
        calls: dict[int, int] = defaultdict(int)

        async def rollout_fn(row):
            k = calls[row["id"]]
            calls[row["id"]] += 1
            rng = random.Random(f"{seed}-{row['id']}-{k}")
            (c,) = await sampler.sample_with_prompt_tokens(
                row["prompt_ids"], max_tokens=rng.choice(LONG_TAIL), ignore_eos=True
            )
            out = c.full_tokens[c.prompt_len :]
            return RolloutSample(
                tokens=c.full_tokens,
                logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
                loss_mask=[0] * c.prompt_len + [1] * len(out),
                reward=sum(t % 2 == 0 for t in out) / len(out) + rng.random() * 1e-3,
            )

        return rollout_fn

    return factory


def run_once(path: str, steps: int, synchronous: bool, offpolicy: int) -> dict[str, float]:
    """One recipe run: medians over the steps after the first of step time, overlap fraction and
    trained tokens per step, and the total of stale-dropped samples."""
    from training.recipes import async_rl_loop
    from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
    from training.utils.metrics import read_metrics

    rows = [{"id": i, "prompt_ids": [1, 10 + i % 50, 20 + i % 7, 201]} for i in range(4 * steps + 8)]
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        cfg = async_rl_loop.Config(
            base_model=path,
            log_path=tmp,
            completions_per_prompt=4,
            prompt_groups_per_step=4,
            max_tokens=16,
            max_steps=steps,
            export_final_model=False,
            shuffle_rows=False,
            synchronous_training=synchronous,
            max_head_offpolicy_versions=offpolicy,
            trainer=TrainerConfig(learning_rate=1e-4, device="cpu"),
            loss=LossConfig(kl_beta=0.0),
            deployment=DeployConfig(engine_config=EngineConfig(max_batch_size=64, max_model_len=512)),
        )
        async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn_factory(), rows=rows)
        metrics = read_metrics(tmp)
    later = metrics[1:] or metrics
    return {
        "step_s": median([m["perf/step_time_s"] for m in later]),
        "overlap_fraction": median([m["perf/overlap_fraction"] for m in later]),
        "trained_tokens_per_step": median([m["train/tokens"] for m in later]),
        "dropped_stale": sum(m.get("offpolicy/dropped_stale", 0.0) for m in metrics),
    }


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--steps", type=int, default=8)
    p.set_defaults(repeats=1)  # recipe runs per setting; each figure is already a median over >= 3 steps
    a = p.parse_args()
    started = time.perf_counter()
    steps = 4 if a.quick else a.steps
    path = model_path("tiny")
    settings = [("synchronous (O=0, drained)", True, 0)] + [(f"async O={o}", False, o) for o in (0, 1, 2)]
    results = {}
    for label, sync, o in settings:
        runs = [run_once(path, steps, sync, o) for _ in range(a.repeats)]
        results[label] = {k: median([r[k] for r in runs]) for k in runs[0]}
    base = results[settings[0][0]]["step_s"]
    rows = [
        row(
            f"tiny, {steps} steps: {label}",
            r["step_s"],
            "s / step (lower is better)",
            settings[0][0],
            base,
            overlap_fraction=round(r["overlap_fraction"], 3),
            trained_tokens_per_step=r["trained_tokens_per_step"],
            dropped_stale=int(r["dropped_stale"]),
        )
        for label, r in results.items()
    ]
    emit(
        "async_overlap",
        rows,
        headline=len(rows) - 1,
        started=started,
        repeats=max(steps - 1, 1),
        notes="Median over steps 2..N of each run; ratio below 1 = faster than synchronous.",
    )


if __name__ == "__main__":
    main()
