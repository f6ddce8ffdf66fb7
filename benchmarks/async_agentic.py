"""Async agentic: agent-shaped rollouts that wait on a simulated environment, synchronous vs async.

    python -m benchmarks.async_agentic [--steps 6] [--repeats 2] [--models tiny[,smollm2]] [--quick]

Through ``training.recipes.async_rl_loop.main`` with its own embedded server per run (fp32, CPU).
An episode makes 1–6 model calls (drawn per (row, completion)); each call generates a
long-tailed number of tokens (``ignore_eos``, so exact), then waits on the "environment" for a
long-tailed time (50 ms × a Pareto(0.9) draw, capped at 2 s: median ~110 ms, about 1 call in 15 over 1 s), then the tool result (4 fixed tokens,
mask 0) is appended and the next call continues the same token sequence. The episode is one
``RolloutRun`` segment with ``metadata={"env_calls": n}``. Every draw depends only on (row,
completion index, call), so every run sees the same workload for a row.

Rows: ``synchronous_training=True`` (the baseline); async ``O`` = 1, 2 × ``stale_policy`` = wait,
drop (× ``inflight_weight_updates`` on / off once the engine reports per-token versions).
Settings run interleaved (round-robin over settings, ``--repeats`` rounds) so load from other
processes hits all of them alike. Figures per setting: median ``perf/step_time_s`` over steps
2..N (median over rounds) as a ratio to synchronous; trainer idle fraction (Σ
``perf/wait_rollout_s`` / Σ ``perf/step_time_s``); groups dropped; mean and p90 of the trained
completion length and of env calls per episode, each relative to synchronous (from
``rollouts.jsonl``, so requeued rows count once, when trained); the token-lag histogram
(``offpolicy/token_lag_hist_k`` summed over the run, as fractions).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import base_parser, emit, median, model_path, row

LENGTHS = {"tiny": [2, 2, 4, 4, 6, 8, 8, 12, 16, 24], "smollm2": [2, 4, 4, 6, 8, 12, 16]}
TOOL_TOKENS = [201, 17, 18, 202]


def env_seconds(rng: random.Random) -> float:
    """Long-tailed environment latency: median ~110 ms, about 1 call in 15 takes 1–2 s."""
    return min(2.0, 0.05 * rng.paretovariate(0.9))


def make_rollout_fn_factory(model: str):
    """A rollout factory for the agentic workload on ``model`` (its length list)."""
    import asyncio

    from training.utils.rl.rollout import RolloutRun, RolloutSample

    lengths = LENGTHS[model]

    def factory(setup):
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)
        calls: dict[int, int] = defaultdict(int)

        async def rollout_fn(row):
            k = calls[row["id"]]
            calls[row["id"]] += 1
            rng = random.Random(f"{row['id']}-{k % 4}")  # a requeued row replays the same episodes
            tokens = list(row["prompt_ids"])
            logprobs, mask, versions = [0.0] * len(tokens), [0] * len(tokens), []
            n_calls = rng.randint(1, 6)
            for call in range(n_calls):
                (c,) = await sampler.sample_with_prompt_tokens(tokens, max_tokens=rng.choice(lengths), ignore_eos=True)
                out = c.output_tokens
                tokens += out
                logprobs += c.inference_logprobs
                mask += [1] * len(out)
                per_token = getattr(c, "token_weight_versions", None)
                # without per-token versions the push drains running calls, so one version served all of it
                versions += list(per_token) if per_token else [c.weight_version] * len(out)
                await asyncio.sleep(env_seconds(rng))
                if call < n_calls - 1:
                    tokens += TOOL_TOKENS
                    logprobs += [0.0] * len(TOOL_TOKENS)
                    mask += [0] * len(TOOL_TOKENS)
            reward = sum(t % 2 == 0 for t in tokens[len(row["prompt_ids"]) :]) / len(tokens) + rng.random() * 1e-3
            sample = RolloutSample(
                tokens=tokens, logprobs=logprobs, loss_mask=mask, reward=reward, token_weight_versions=versions
            )
            return RolloutRun(segments=[sample], reward=reward, metadata={"env_calls": n_calls})

        return rollout_fn

    return factory


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))])


def run_once(
    model: str, path: str, steps: int, groups: int, sync: bool, offpolicy: int, policy: str, inflight: bool
) -> dict:
    """One recipe run; the raw per-run figures."""
    from training.recipes import async_rl_loop
    from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
    from training.utils.metrics import read_metrics

    rows = [{"id": i, "prompt_ids": [1, 10 + i % 50, 20 + i % 7, 30 + i % 11, 201]} for i in range(groups * steps * 3)]
    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as tmp:
        cfg = async_rl_loop.Config(
            base_model=path,
            log_path=tmp,
            completions_per_prompt=4,
            prompt_groups_per_step=groups,
            max_tokens=64,
            max_steps=steps,
            export_final_model=False,
            shuffle_rows=False,
            synchronous_training=sync,
            max_head_offpolicy_versions=offpolicy,
            stale_policy=policy,
            inflight_weight_updates=inflight,
            trainer=TrainerConfig(
                learning_rate=1e-5, micro_batch_tokens=4096 if model == "tiny" else 1024, device="cpu"
            ),
            loss=LossConfig(kl_beta=0.0),
            deployment=DeployConfig(engine_config=EngineConfig(max_batch_size=32, max_model_len=1024)),
        )
        async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn_factory(model), rows=rows)
        metrics = [m for m in read_metrics(tmp) if "perf/step_time_s" in m]
        trained = [json.loads(line) for line in (Path(tmp) / "rollouts.jsonl").read_text().splitlines()]
    later = metrics[1:] or metrics
    lag: dict[int, float] = defaultdict(float)
    for m in metrics:
        for key, v in m.items():
            if key.startswith("offpolicy/token_lag_hist_"):
                lag[int(key.rsplit("_", 1)[1])] += v
    return {
        "step_s": median([m["perf/step_time_s"] for m in later]),
        "step_times": [m["perf/step_time_s"] for m in later],
        "idle": sum(m["perf/wait_rollout_s"] for m in later) / sum(m["perf/step_time_s"] for m in later),
        "trainer_wait_s": sum(m.get("offpolicy/trainer_wait_s", 0.0) for m in later) / len(later),
        "dropped_groups": sum(m.get("offpolicy/dropped_stale_groups", 0.0) for m in metrics),
        "lengths": [t["trainable_tokens"] for t in trained],
        "env_calls": [t["metadata"]["env_calls"] for t in trained],
        "lag": dict(lag),
    }


def summarise(runs: list[dict]) -> dict:
    lengths = [x for r in runs for x in r["lengths"]]
    calls = [x for r in runs for x in r["env_calls"]]
    lag: dict[int, float] = defaultdict(float)
    for r in runs:
        for k, v in r["lag"].items():
            lag[k] += v
    total = sum(lag.values()) or 1.0
    times = sorted(t for r in runs for t in r["step_times"])
    spread = (percentile(times, 0.75) - percentile(times, 0.25)) / median(times)
    return {
        "step_s": median([r["step_s"] for r in runs]),
        "spread": spread,
        "idle": median([r["idle"] for r in runs]),
        "trainer_wait_s": median([r["trainer_wait_s"] for r in runs]),
        "dropped_groups": sum(r["dropped_groups"] for r in runs) / len(runs),
        "len_mean": sum(lengths) / len(lengths),
        "len_p90": percentile(lengths, 0.9),
        "calls_mean": sum(calls) / len(calls),
        "calls_p90": percentile(calls, 0.9),
        "lag": {k: round(lag[k] / total, 3) for k in sorted(lag)},
    }


def settings(inflight_available: bool) -> list[tuple[str, bool, int, str, bool]]:
    """(label, synchronous, O, stale_policy, inflight) for every row."""
    out = [("synchronous", True, 0, "wait", False)]
    for o in (1, 2):
        for policy in ("wait", "drop"):
            for inflight in (False, True) if inflight_available else (False,):
                label = f"async O={o} {policy}" + (" in-flight" if inflight else "")
                out.append((label, False, o, policy, inflight))
    return out


def main() -> None:
    from training.deployment.client import Completion

    p = base_parser(__doc__)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--groups", type=int, default=4, help="prompt groups per step (4 completions each)")
    p.add_argument(
        "--models",
        default="tiny",
        help="comma-separated: tiny, smollm2 (SmolLM2 trains at minutes per step on a shared 2-core machine: opt in)",
    )
    p.add_argument("--smollm2-repeats", type=int, default=1, help="rounds for SmolLM2 (each run is minutes)")
    p.set_defaults(repeats=2)
    a = p.parse_args()
    started = time.perf_counter()
    models = ["tiny"] if a.quick else [m for m in a.models.split(",") if m]
    steps = 3 if a.quick else a.steps
    repeats = 1 if a.quick else a.repeats
    inflight_available = "token_weight_versions" in getattr(Completion, "__dataclass_fields__", {})
    table = settings(inflight_available)
    rows = []
    for model in models:
        path = model_path(model)
        m_steps = steps if model == "tiny" else max(3, steps - 2)
        runs: dict[str, list[dict]] = defaultdict(list)
        for _ in range(
            repeats if model == "tiny" else min(repeats, a.smollm2_repeats)
        ):  # interleaved: every setting once per round
            for label, sync, o, policy, inflight in table:
                runs[label].append(run_once(model, path, m_steps, a.groups, sync, o, policy, inflight))
        res = {label: summarise(r) for label, r in runs.items()}
        base = res["synchronous"]
        for label, r in res.items():
            rows.append(
                row(
                    f"{model}, {m_steps} steps: {label}",
                    r["step_s"],
                    "s / step (lower is better)",
                    "synchronous",
                    base["step_s"],
                    step_iqr_over_median=round(r["spread"], 2),
                    trainer_idle=round(r["idle"], 3),
                    trainer_wait_s=round(r["trainer_wait_s"], 2),
                    groups_dropped=r["dropped_groups"],
                    len_mean_vs_sync=round(r["len_mean"] / base["len_mean"], 3),
                    len_p90_vs_sync=round(r["len_p90"] / base["len_p90"], 3),
                    calls_mean_vs_sync=round(r["calls_mean"] / base["calls_mean"], 3),
                    calls_p90_vs_sync=round(r["calls_p90"] / base["calls_p90"], 3),
                    token_lag=" ".join(f"{k}:{v:g}" for k, v in r["lag"].items()),
                )
            )
    emit(
        "async_agentic",
        rows,
        headline=1,
        started=started,
        repeats=repeats,
        notes=(
            "Step time: median over steps 2..N of each run, then over the interleaved rounds; trainer_idle = "
            "Σ wait_rollout_s / Σ step_time_s; groups_dropped per run; length / env-call ratios over every "
            "trained sample of all rounds, against the synchronous row; step_iqr_over_median = the spread of the "
            "step times within a setting (run-to-run noise); token_lag = share of trained tokens "
            "k versions behind the weights they were trained from (k:share)."
            + (
                ""
                if inflight_available
                else " In-flight rows: not measured, the engine on this branch "
                "does not report per-token versions yet (issue #16 item 2)."
            )
        ),
    )


if __name__ == "__main__":
    main()
