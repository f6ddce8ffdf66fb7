"""On-policy distillation against RL from the same start: held-out accuracy against training wall time.

    python -m benchmarks.distillation [--budget-s 600] [--teacher runs/arithmetic_smollm2/final] [--seeds 0]
        [--eval-interval 4] [--work-dir DIR] [--note TEXT] [--quick]

Two runs from the base SmolLM2-135M-Instruct, one after the other on this machine, each its own process:
- RL: ``training/examples/rl/arithmetic_smollm2`` as shipped (its ``train.py`` config and ``rollout.py``:
  grpo on the exact-answer reward, 4 problems × 8 replies per step, the zero-variance filter);
- distillation: ``training/examples/rl/distillation_smollm2`` as shipped (8 problems × 4 replies per step,
  the teacher's per-token reward, ``importance_sampling``), its teacher the ``final`` export of a run of the
  arithmetic example (``--teacher``; the benchmark stops with one line when it is missing).
Both evaluate in the run (the recipe's own eval: the 100 problems of the arithmetic example's ``eval.jsonl``,
sampled at the examples' temperature 0.7) before the first step and every ``--eval-interval`` steps. What the
benchmark fixes for both (``HARNESS``): the seed, no checkpoints, no export, enough epochs that the rows never
run out, ``max_steps`` large: each run is stopped (SIGTERM, which the recipe unwinds like Ctrl-C) once its
training wall time passes ``--budget-s``.

Training wall time: the sum over trained steps of the recipe's own step phases ``perf/wait_rollout_s``,
``perf/teacher_s``, ``perf/train_s`` and ``perf/weight_sync_s``: sampling, the teacher's scoring, training
and weight pushes; not the evals (the same for both sides per eval), nor start-up (process, model
conversion, servers: reported apart as ``startup_s``). Each eval gives one point of the curve
(training seconds so far, held-out accuracy). Rows: each side's held-out accuracy at its last eval inside the
budget, against RL's; and the seconds of training each side took to first reach a held-out accuracy
(the lower of the two sides' final accuracies), against RL's. The teacher's own accuracy (the same in-run
protocol would need a third run; here greedy ``transformers`` generation, ``end_to_end.evaluate``) is in the
notes for context.

The real figure takes about 40 minutes on 2 idle cores (budget 600 s per side plus the evals and start-up);
the teacher must exist first (the arithmetic example, about 16 minutes). ``--quick``: the tiny model as the
student and another tiny model as the teacher, a 15 s budget (a smoke test of the harness, not a figure).
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks.common import base_parser, emit, median, row, sig
from benchmarks.end_to_end import evaluate, example_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "training" / "examples" / "rl"
SIDES = {"RL (arithmetic_smollm2)": "arithmetic_smollm2", "distillation (distillation_smollm2)": "distillation_smollm2"}
"""Label → example folder; the first is the baseline."""
TRAIN_PHASES = ("perf/wait_rollout_s", "perf/teacher_s", "perf/train_s", "perf/weight_sync_s")
"""The step phases that make up training wall time (not evals, not checkpoints)."""
DEFAULT_TEACHER = "runs/arithmetic_smollm2/final"
POLL_S = 1.0


def harness(model: str, log_path: str, seed: int, eval_interval: int, eval_rows: str) -> list[str]:
    """What the benchmark fixes in both examples' configs."""
    return [
        f"base_model={model}",
        f"log_path={log_path}",
        f"seed={seed}",
        f"trainer.seed={seed}",
        "max_steps=100000",
        "epochs=20",
        f"eval_rows={eval_rows}",
        f"eval_interval={eval_interval}",
        "dcp_save_interval=0",
        "export_final_model=false",
        "if_log_path_exists=overwrite",
    ]


def run_side_here(example: str, overrides: list[str]) -> None:
    """Inside the subprocess: one recipe run of ``example`` with ``overrides`` (stopped by SIGTERM at the budget)."""
    from training.recipes import async_rl_loop

    cfg, rollout = example_config(overrides, EXAMPLES / example)
    async_rl_loop.main(
        cfg, rollout_fn_factory=rollout.make_rollout_fn, rows=EXAMPLES / "arithmetic_smollm2" / "data.jsonl"
    )


def read_rows(path: Path) -> list[dict]:
    """The complete lines of a ``metrics.jsonl`` being written (a torn last line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def curve(rows: list[dict]) -> list[tuple[float, float, int]]:
    """(training seconds so far, held-out accuracy, steps trained) at every eval of a run, in order."""
    points, train_s, steps = [], 0.0, 0
    for r in rows:
        if "train/loss" in r:
            train_s += sum(r.get(k, 0.0) for k in TRAIN_PHASES)
            steps += 1
        if "eval/pass_rate" in r:
            points.append((train_s, r["eval/pass_rate"], steps))
    return points


def run_side(example: str, overrides: list[str], budget_s: float, log_file: Path, timeout_s: float) -> dict:
    """One side in its own process, stopped once its training wall time passes ``budget_s``."""
    metrics = Path(next(o for o in overrides if o.startswith("log_path=")).split("=", 1)[1]) / "metrics.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.distillation", "--run-side", example, *overrides]
    t0 = time.perf_counter()
    first_step_at: Optional[float] = None
    stopped = False
    with log_file.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                rows = read_rows(metrics)
                if first_step_at is None and any("train/loss" in r for r in rows):
                    first_step_at = time.perf_counter() - t0
                trained = sum(sum(r.get(k, 0.0) for k in TRAIN_PHASES) for r in rows if "train/loss" in r)
                if trained >= budget_s and not stopped:
                    proc.send_signal(signal.SIGTERM)  # the recipe unwinds like Ctrl-C: servers stopped
                    stopped = True
                if time.perf_counter() - t0 > timeout_s:
                    proc.kill()
                    raise RuntimeError(f"{example}: no end within {timeout_s:.0f} s; see {log_file}")
        finally:
            if proc.poll() is None:
                proc.kill()
    if proc.returncode not in (0, 128 + signal.SIGTERM):
        raise RuntimeError(f"{example} failed (exit {proc.returncode}); {log_file}:\n{log_file.read_text()[-3000:]}")
    rows = read_rows(metrics)
    trained = [r for r in rows if "train/loss" in r]
    points = curve(rows)
    points = points[:1] + [p for p in points[1:] if p[0] <= budget_s]
    in_budget, spent = 0, 0.0
    for r in trained:
        spent += sum(r.get(k, 0.0) for k in TRAIN_PHASES)
        in_budget += spent <= budget_s
    return {
        "curve": points,
        "steps": in_budget,
        "step_s": median([r["perf/step_time_s"] for r in trained[1:]] or [r["perf/step_time_s"] for r in trained]),
        "teacher_s": median([r.get("perf/teacher_s", 0.0) for r in trained]) if trained else 0.0,
        "startup_s": first_step_at,
        "stopped_at_budget": stopped,
    }


def seconds_to_reach(points: list[tuple[float, float, int]], target: float) -> Optional[float]:
    """Training seconds of the first eval at or above ``target`` (None: never)."""
    return next((t for t, acc, _ in points if acc >= target), None)


def figure_rows(runs: dict[str, list[dict]], budget_s: float) -> list[dict]:
    """Per side: accuracy at its last eval in the budget, and seconds to reach the lower final accuracy, vs RL."""
    base_label = next(iter(SIDES))
    finals = {label: median([rs["curve"][-1][1] for rs in r]) for label, r in runs.items()}
    target = min(finals.values())
    reach = {}
    for label, r in runs.items():
        times = [seconds_to_reach(rs["curve"], target) for rs in r]
        reach[label] = median([t for t in times if t is not None]) if all(t is not None for t in times) else None
    out = []
    for label, r in runs.items():
        text = " ".join(f"{t:.0f}s:{acc:.2f}" for t, acc, _ in r[0]["curve"])
        out.append(
            row(
                f"{label}, {budget_s:.0f} s of training",
                finals[label],
                "held-out accuracy at the budget",
                base_label,
                finals[base_label],
                steps=median([rs["steps"] for rs in r]),
                s_per_step=sig(median([rs["step_s"] for rs in r]), 3),
                curve=text,
            )
        )
    for label in runs:
        if reach[label] is not None and reach[base_label]:
            out.append(
                row(
                    f"{label}: training to accuracy {target:.2f}",
                    max(reach[label], 1e-9),
                    "s (lower is better)",
                    base_label,
                    reach[base_label],
                )
            )
    return out


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--budget-s", type=float, default=600.0, help="training wall time per side (s)")
    p.add_argument("--teacher", default=DEFAULT_TEACHER, help="the teacher folder (the arithmetic example's export)")
    p.add_argument("--model", default="smollm2", help="the student's starting model (both sides)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; each seed runs both sides")
    p.add_argument("--eval-interval", type=int, default=4, help="steps between in-run evals")
    p.add_argument("--work-dir", help="keep every run's folder and log here (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=3 * 3600.0, help="seconds per side before it is killed")
    p.add_argument("--note", default="", help="conditions of this run for the report")
    p.add_argument("--run-side", nargs="+", help="internal: EXAMPLE key=value ...: one run, in this process")
    a = p.parse_args()
    if a.run_side:
        run_side_here(a.run_side[0], a.run_side[1:])
        return
    started = time.perf_counter()
    seeds = [int(s) for s in a.seeds.split(",") if s]
    extra: list[str] = []
    if a.quick:
        from training.models.build_tiny import ensure_tiny_model

        a.model, a.teacher, a.budget_s, a.eval_interval = "tiny", ensure_tiny_model(weight_seed=1), 15.0, 1
        extra = ["completions_per_prompt=2", "prompt_groups_per_step=2", "max_tokens=8", "dynamic_filter_fn=null"]
    teacher = Path(a.teacher) if Path(a.teacher).is_absolute() else ROOT / a.teacher
    if not teacher.is_dir():
        sys.exit(
            f"no teacher at {teacher}: run the arithmetic example first (python "
            "training/examples/rl/arithmetic_smollm2/train.py from the repository root exports "
            f"{DEFAULT_TEACHER}), or pass --teacher PATH"
        )
    eval_source = EXAMPLES / "arithmetic_smollm2" / "eval.jsonl"
    runs: dict[str, list[dict]] = {label: [] for label in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        work = Path(a.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        eval_rows = eval_source
        if a.quick:  # 8 held-out problems: the tiny model only shows the harness works
            eval_rows = work / "eval8.jsonl"
            eval_rows.write_text("".join(eval_source.read_text().splitlines(keepends=True)[:8]))
        teacher_accuracy = None
        if not a.quick:
            _, rollout = example_config([], EXAMPLES / "arithmetic_smollm2")
            rows = [json.loads(l) for l in eval_source.read_text().splitlines() if l.strip()]
            teacher_accuracy = evaluate(str(teacher), rows, rollout, 48)
        for k, seed in enumerate(seeds):
            order = list(SIDES.items()) if k % 2 == 0 else list(SIDES.items())[::-1]  # alternate who goes first
            for label, example in order:
                log_path = work / f"{example}-seed{seed}"
                overrides = harness(a.model, str(log_path), seed, a.eval_interval, str(eval_rows)) + extra
                if example == "distillation_smollm2":
                    overrides.append(f"distillation.teacher_model={teacher}")
                r = run_side(example, overrides, a.budget_s, Path(str(log_path) + ".log"), a.timeout)
                runs[label].append({**r, "seed": seed})
                (work / "runs.json").write_text(json.dumps(runs, indent=1))
                print(f"{label}, seed {seed}: {r['steps']} steps, curve {r['curve']}", file=sys.stderr, flush=True)
    base = runs[next(iter(SIDES))][0]["curve"][0][1]
    emit(
        "distillation",
        figure_rows(runs, a.budget_s),
        started=started,
        repeats=len(seeds),
        notes=f"{a.note + ' ' if a.note else ''}Student {a.model}, teacher {a.teacher}"
        + (f" (greedy held-out accuracy {teacher_accuracy:.2f})" if teacher_accuracy is not None else "")
        + f"; held-out accuracy before training {base:.2f}; budget {a.budget_s:.0f} s of training per side, "
        f"an eval every {a.eval_interval} steps; seeds {seeds}. `curve`: training seconds:accuracy at each eval "
        f"(first seed). Command: `python -m benchmarks.distillation {shlex.join(sys.argv[1:])}`.",
        extra={"runs": runs, "teacher_accuracy": teacher_accuracy},
    )


if __name__ == "__main__":
    main()
