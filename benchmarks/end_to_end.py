"""End to end against TRL: the SmolLM2 arithmetic example vs TRL's ``GRPOTrainer`` on the same task.

    python -m benchmarks.end_to_end [--steps 8] [--seeds 0] [--set key=value ...] [--variant LABEL key=value ...]
        [--sides ours,trl,trl-vllm] [--trl-vllm-dtype float32] [--work-dir DIR] [--note TEXT]

Ours: ``training/examples/rl/arithmetic_smollm2`` as shipped (its ``train.py`` config and
``rollout.py``, through ``async_rl_loop.main``), with only what a benchmark must fix overridden
(``HARNESS_OVERRIDES``: model, steps, seed, rows in file order, no in-run eval). ``--variant``
adds a run of ours with more ``key=value`` overrides (e.g. a trainer speed-up switched on: bf16
autocast is ``--variant bf16 trainer.compute_dtype=bfloat16``), as ``train.py`` takes them;
``--set key=value ...`` changes the example's config for both sides (a smaller batch for a short
run on a shared machine). Baseline: TRL's ``GRPOTrainer`` with its own ``generate`` in
``.venv-trl`` (``scripts/setup_trl.sh``), run by ``benchmarks/trl_grpo.py`` with settings derived
from ours (``trl_settings``); a second TRL row (side ``trl-vllm``) is the same trainer with vLLM's CPU build
generating in colocate mode (``use_vllm=True, vllm_mode="colocate"``, the configuration a TRL user picks for
speed) in ``.venv-trl-vllm`` (``scripts/setup_trl_vllm.sh``), with TRL's weight sync replaced because it fails
on vLLM's CPU build (``benchmarks/trl_vllm_cpu.py``; server mode cannot sync weights without CUDA:
``benchmarks/trl_grpo.py`` says why). Every run is its own process; for each seed the runs alternate
(ours, variants, TRL, TRL + vLLM), so noise from other users of the machine hits every side alike. With
``--work-dir DIR`` each run's stderr goes to ``DIR/<run>.log`` (follow a long run there: TRL's side
prints one line per step) and ``DIR/runs.json`` is rewritten after every run.

Figures, the same definition for every run:
- s / step: median wall time of the steps after the first (ours: ``perf/step_time_s``; TRL:
  ``on_step_end`` to ``on_step_end``), median over seeds; ratio = run / TRL;
- trained tok/s: prompt + completion tokens trained per step (no padding) / that step's wall time,
  median over the steps after the first;
- held-out accuracy: each final model folder loaded with ``transformers`` and scored by
  ``evaluate`` (greedy, the example's chat prompt, ``max_tokens`` new tokens, the example's
  ``final_number``) on the example's ``eval.jsonl``; the base model is scored the same way once.
"""

from __future__ import annotations

import importlib.util
import json
import runpy
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from benchmarks.common import base_parser, emit, median, model_path, row, sig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "training" / "examples" / "rl" / "arithmetic_smollm2"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
TRL_VLLM_PYTHON = ROOT / ".venv-trl-vllm" / "bin" / "python"
TRL_SCRIPT = ROOT / "benchmarks" / "trl_grpo.py"


@dataclass(frozen=True)
class TrlSide:
    """One TRL baseline: its row label, its venv's interpreter, the ``generation`` it asks ``trl_grpo.py``
    for, and the script that builds its venv."""

    label: str
    python: Path
    generation: str
    setup: str


TRL_SIDES = {
    "trl": TrlSide("TRL GRPOTrainer", TRL_PYTHON, "generate", "scripts/setup_trl.sh"),
    "trl-vllm": TrlSide(
        "TRL GRPOTrainer + vLLM colocate", TRL_VLLM_PYTHON, "vllm_colocate", "scripts/setup_trl_vllm.sh"
    ),
}
"""``--sides`` names of the TRL runs; the first one run is the baseline of every ratio."""


def harness_overrides(model: str, steps: int, seed: int, log_path: str) -> list[str]:
    """What the benchmark fixes in the example's config: model, length, seed, file-order rows, no in-run eval."""
    return [
        f"base_model={model}",
        f"log_path={log_path}",
        f"max_steps={steps}",
        f"seed={seed}",
        f"trainer.seed={seed}",
        "shuffle_rows=false",
        "eval_rows=null",
        "eval_interval=0",
        "export_final_model=true",
        "dcp_save_interval=0",
    ]


def example_config(overrides: list[str], example: Path = EXAMPLE):
    """The example's ``cfg`` (its ``train.py`` run as a module, not as ``__main__``: it builds ``cfg`` and
    neither reads ``sys.argv`` nor trains) with ``overrides`` applied, and its ``rollout`` module (loaded
    from its file, whatever other module named ``rollout`` is imported). ``example``: the example's folder
    (default the arithmetic one)."""
    from training.utils.cli import apply_overrides

    spec = importlib.util.spec_from_file_location(f"{example.name}_rollout", example / "rollout.py")
    rollout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rollout)
    saved_module, sys.modules["rollout"] = sys.modules.get("rollout"), rollout  # train.py: from rollout import ...
    try:
        train = runpy.run_path(str(example / "train.py"), run_name=f"{example.name}_train")
    finally:
        if saved_module is None:
            sys.modules.pop("rollout", None)
        else:
            sys.modules["rollout"] = saved_module
    return apply_overrides(train["cfg"], overrides), rollout


def run_ours_here(overrides: list[str]) -> dict:
    """Inside the subprocess: one recipe run; per-step wall time, trained tokens and reward."""
    from training.recipes import async_rl_loop
    from training.utils.metrics import read_metrics

    cfg, rollout = example_config(overrides)
    t0 = time.perf_counter()
    result = async_rl_loop.main(cfg, rollout_fn_factory=rollout.make_rollout_fn, rows=EXAMPLE / "data.jsonl")
    train_s = time.perf_counter() - t0
    steps = [m for m in read_metrics(result["log_path"]) if "train/loss" in m]  # the folder it wrote to
    return {
        "side": "ours",
        "step_s": [m["perf/step_time_s"] for m in steps],
        "tokens": [m["train/tokens"] for m in steps],
        "reward_mean": [m["rollout/reward_mean"] for m in steps],
        "filtered_groups": sum(m.get("rollout/filtered_groups", 0.0) for m in steps),
        "train_s": train_s,
        "final_model": result["final_model"],
        "config": cfg.to_dict(),
    }


def _last_json(stdout: str) -> dict:
    lines = [l for l in stdout.splitlines() if l.startswith('{"')]
    if not lines:
        raise RuntimeError("no JSON result line in the run's output")
    return json.loads(lines[-1])


def run_logged(cmd: list[str], log_file: Path, timeout_s: float) -> dict:
    """Run ``cmd`` with its stderr in ``log_file`` (follow a long run there); its last JSON line, plus
    ``process_s`` (the whole process: loading, server start, training, saving)."""
    t0 = time.perf_counter()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w") as log:
        out = subprocess.run(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout_s, check=False
        )
    if out.returncode != 0:
        tail = log_file.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {out.returncode}), {log_file}:\n{tail}")
    return {**_last_json(out.stdout), "process_s": time.perf_counter() - t0}


def run_ours(overrides: list[str], log_file: Path, timeout_s: float) -> dict:
    """One run of ours in its own process (``--run-ours``)."""
    return run_logged([sys.executable, "-m", "benchmarks.end_to_end", "--run-ours", *overrides], log_file, timeout_s)


def micro_batch_samples(batch: int, longest_sample: int, micro_batch_tokens: int) -> int:
    """TRL's ``per_device_train_batch_size``: the largest divisor of ``batch`` whose padded
    micro-batch (samples × longest prompt + completion) fits ours' ``micro_batch_tokens``."""
    fits = [d for d in range(1, batch + 1) if batch % d == 0 and d * longest_sample <= micro_batch_tokens]
    return max(fits) if fits else 1


def trl_settings(cfg, longest_prompt: int) -> dict:
    """The hyperparameters ``trl_grpo.py`` needs, read from our config (one source for both sides).

    Refuses settings TRL's ``GRPOTrainer`` has no counterpart for here (another policy loss,
    PPO mini-batches, another aggregation, another advantage estimator, masked importance sampling, a
    learning-rate schedule)."""
    if cfg.loss.policy_loss != "grpo":
        raise ValueError(f"loss.policy_loss: the TRL baseline mirrors grpo only, got {cfg.loss.policy_loss!r}")
    if cfg.ppo_mini_batches != 1:
        raise ValueError(f"ppo_mini_batches: the TRL baseline mirrors 1 only, got {cfg.ppo_mini_batches}")
    if cfg.loss.aggregation != "token_mean":
        raise ValueError(f"loss.aggregation: TRL's dapo loss is token_mean, got {cfg.loss.aggregation!r}")
    if cfg.advantage_estimator not in ("grpo", "dr_grpo"):
        raise ValueError(f"advantage: the TRL baseline mirrors grpo and dr_grpo only, got {cfg.advantage_estimator!r}")
    if cfg.loss.mis_level != "off":
        raise ValueError(
            f"loss.mis_level: the TRL baseline has no masked importance sampling, got {cfg.loss.mis_level!r}"
        )
    if cfg.trainer.lr_schedule != "constant" or cfg.trainer.warmup_steps:
        raise ValueError(
            f"trainer.lr_schedule: the TRL baseline runs at a constant rate, got {cfg.trainer.lr_schedule!r} "
            f"with warmup_steps={cfg.trainer.warmup_steps}"
        )
    batch = cfg.prompt_groups_per_step * cfg.completions_per_prompt
    return {
        "max_steps": cfg.max_steps,
        "max_model_len": longest_prompt + cfg.max_tokens,  # vLLM's context (TRL + vLLM only)
        "seed": cfg.seed,
        "prompt_groups_per_step": cfg.prompt_groups_per_step,
        "completions_per_prompt": cfg.completions_per_prompt,
        "max_tokens": cfg.max_tokens,
        "micro_batch_samples": micro_batch_samples(
            batch, longest_prompt + cfg.max_tokens, cfg.trainer.micro_batch_tokens
        ),
        "temperature": cfg.temperature,
        "learning_rate": cfg.trainer.learning_rate,
        "adam_betas": list(cfg.trainer.adam_betas),
        "weight_decay": cfg.trainer.weight_decay,
        "grad_clip_norm": cfg.trainer.grad_clip_norm,
        "kl_beta": cfg.loss.kl_beta,
        "ppo_epochs": cfg.ppo_epochs,
        "eps_low": 0.2 if cfg.loss.eps_low is None else cfg.loss.eps_low,
        "eps_high": 0.2 if cfg.loss.eps_high is None else cfg.loss.eps_high,
        "advantage_std_scaling": cfg.advantage_estimator == "grpo",
    }


def require_venv(side: TrlSide) -> None:
    """Fail before any run when ``side``'s venv is missing, naming the script that builds it."""
    if not side.python.exists():
        raise FileNotFoundError(f"no venv for {side.label!r} at {side.python}: run bash {side.setup}")


def run_trl(model: str, settings: dict, out_dir: str, timeout_s: float, side: TrlSide = TRL_SIDES["trl"]) -> dict:
    """One TRL run in ``side``'s venv, generating as ``side.generation`` says (its log in ``out_dir``.log)."""
    require_venv(side)
    settings = {**settings, "generation": side.generation}
    return run_logged(
        [
            str(side.python),
            str(TRL_SCRIPT),
            "--model",
            model,
            "--rows",
            str(EXAMPLE / "data.jsonl"),
            "--out",
            out_dir,
            "--settings",
            json.dumps(settings),
        ],
        Path(out_dir + ".log"),
        timeout_s,
    )


def tiny_h128() -> str:
    """The tiny Qwen3 with head_dim 32 (``--quick`` with the trl-vllm side: vLLM's CPU attention has no
    kernel for the default tiny model's head_dim 16), built into the cache folder on first use."""
    from training.models.build_tiny import build_tiny
    from training.utils.cache import cache_dir

    path = cache_dir() / "tiny-qwen3-h128"
    if not (path / "config.json").exists():
        build_tiny(path, hidden=128)
    return str(path)


def chat_prompts(tokenizer, rows: list[dict], instruction: str) -> list[list[int]]:
    """The example's prompt ids: one user message ``question\\ninstruction`` through the chat template."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{r['question']}\n{instruction}"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for r in rows
    ]


def longest_prompt_tokens(path: str, rollout) -> int:
    """Tokens of the longest training prompt (sizes TRL's padded micro-batches)."""
    from transformers import AutoTokenizer

    rows = [json.loads(l) for l in (EXAMPLE / "data.jsonl").read_text().splitlines() if l.strip()]
    return max(map(len, chat_prompts(AutoTokenizer.from_pretrained(path), rows, rollout.INSTRUCTION)))


def evaluate(folder: str, rows: list[dict], rollout, max_tokens: int, batch_size: int = 25) -> float:
    """Held-out accuracy of the model in ``folder``: greedy ``generate`` (left-padded batches, fp32),
    reply decoded without special tokens, right when ``rollout.final_number(reply)`` is the answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = chat_prompts(tokenizer, rows, rollout.INSTRUCTION)
    right = 0
    for i in range(0, len(rows), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad
            )
        for r, reply in zip(rows[i : i + batch_size], out[:, width:]):
            right += rollout.final_number(tokenizer.decode(reply, skip_special_tokens=True)) == r["answer"]
    return right / len(rows)


def summarize(run: dict) -> dict[str, float]:
    """Median s / step and trained tok/s over the steps after the first (all steps when there is one)."""
    pairs = list(zip(run["step_s"], run["tokens"]))
    later = pairs[1:] or pairs
    return {
        "step_s": median([s for s, _ in later]),
        "tok_s": median([t / s for s, t in later]),
        "tokens_per_step": median([t for _, t in later]),
    }


def spread(values: list[float]) -> str:
    return f"{sig(min(values), 3)}..{sig(max(values), 3)}" if len(values) > 1 else "—"


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--steps", type=int, default=8, help="training steps per run")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; every seed runs every side")
    p.add_argument("--model", default="smollm2", help="smollm2 (the example's), tiny, or a folder")
    p.add_argument(
        "--sides",
        default="ours,trl,trl-vllm",
        help="comma-separated: ours, trl (TRL with its generate), trl-vllm (TRL with vLLM colocate)",
    )
    p.add_argument(
        "--trl-vllm-dtype",
        default="",
        help="vLLM's dtype in the trl-vllm runs (default: vLLM's own choice, as TRL leaves it: bf16 on CPU)",
    )
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="key=value",
        help="overrides of the example's config for both sides (every run of ours and TRL's settings)",
    )
    p.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar="LABEL key=value",
        help="one more run of ours: a label, then key=value overrides of the example's config",
    )
    p.add_argument("--eval-rows", type=int, default=0, help="score only the first N held-out rows (0 = all)")
    p.add_argument("--skip-eval", action="store_true", help="no held-out accuracy (speed figures only)")
    p.add_argument("--work-dir", help="keep every run's folder here (default: a temporary folder, removed)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per run")
    p.add_argument("--note", default="", help="conditions of this run for the report (e.g. the machine was shared)")
    p.add_argument("--run-ours", nargs="*", help="internal: one run of ours with these overrides, print its JSON")
    a = p.parse_args()
    if a.run_ours is not None:
        print(json.dumps(run_ours_here(a.run_ours)), flush=True)
        return
    started = time.perf_counter()
    sides = [s for s in a.sides.split(",") if s]
    unknown = sorted(set(sides) - {"ours", *TRL_SIDES})
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown}; choose from ours, {', '.join(TRL_SIDES)}")
    trl_sides = [TRL_SIDES[s] for s in TRL_SIDES if s in sides]
    for side in trl_sides:
        require_venv(side)
    if a.quick:  # the tiny model cannot solve anything: no zero-variance filter, or every group is dropped
        a.model, a.steps, a.eval_rows = ("tiny-h128" if "trl-vllm" in sides else "tiny"), 1, 8
    seeds = [int(s) for s in a.seeds.split(",") if s]
    both = ["dynamic_filter_fn=null", "prompt_groups_per_step=2", "completions_per_prompt=4"] if a.quick else []
    both += a.set  # e.g. a smaller batch: TRL's settings are derived from the same config
    ours_label = f"ours, example with {' '.join(a.set)}" if a.set else "ours, example defaults"
    variants = [(ours_label, [])] * ("ours" in sides) + [(v[0], v[1:]) for v in a.variant]
    path = tiny_h128() if a.model == "tiny-h128" else model_path(a.model)
    eval_rows = [json.loads(l) for l in (EXAMPLE / "eval.jsonl").read_text().splitlines() if l.strip()]
    eval_rows = [] if a.skip_eval else eval_rows[: a.eval_rows or None]

    def score(folder: str) -> Optional[float]:
        return evaluate(folder, eval_rows, rollout, cfg.max_tokens) if eval_rows else None

    runs: dict[str, list[dict]] = {label: [] for label, _ in variants}
    runs.update({side.label: [] for side in trl_sides})
    settings: Optional[dict] = None
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        work = Path(a.work_dir or tmp)
        cfg, rollout = example_config(harness_overrides(path, a.steps, 0, str(work / "probe")) + both)
        base_accuracy = score(path)
        longest_prompt = longest_prompt_tokens(path, rollout)
        print(f"base model: held-out accuracy {base_accuracy}", file=sys.stderr, flush=True)
        for seed in seeds:
            for i, (label, extra) in enumerate(variants):
                log = str(work / f"ours{i}-seed{seed}")
                r = run_ours(
                    harness_overrides(path, a.steps, seed, log) + both + list(extra), Path(log + ".log"), a.timeout
                )
                runs[label].append({**r, "accuracy": score(r["final_model"])})
                (work / "runs.json").write_text(json.dumps(runs, indent=1))
                print(
                    f"{label}, seed {seed}: {summarize(r)} accuracy {runs[label][-1]['accuracy']}",
                    file=sys.stderr,
                    flush=True,
                )
            for side in trl_sides:
                cfg, _ = example_config(harness_overrides(path, a.steps, seed, str(work / "probe")) + both)
                settings = trl_settings(cfg, longest_prompt)
                extra_settings = {"vllm_dtype": a.trl_vllm_dtype} if a.trl_vllm_dtype else {}
                r = run_trl(
                    path, {**settings, **extra_settings}, str(work / f"{side.generation}-seed{seed}"), a.timeout, side
                )
                runs[side.label].append({**r, "accuracy": score(r["final_model"])})
                (work / "runs.json").write_text(json.dumps(runs, indent=1))
                print(
                    f"{side.label}, seed {seed}: {summarize(r)} accuracy {runs[side.label][-1]['accuracy']}",
                    file=sys.stderr,
                    flush=True,
                )
    emit(
        "end_to_end",
        figure_rows(runs, a.steps, seeds, base_accuracy),
        started=started,
        repeats=len(seeds),
        notes=f"{a.note + ' ' if a.note else ''}{a.model}, {a.steps} steps per run, seeds {seeds}, "
        + (
            f"{len(eval_rows)} held-out rows; base model held-out accuracy {base_accuracy:.3f}. "
            if eval_rows
            else "held-out accuracy not measured (--skip-eval). "
        )
        + f"Command: `python -m benchmarks.end_to_end {shlex.join(sys.argv[1:])}`.",
        extra={
            "settings": {
                "trl": settings,
                "base_accuracy": base_accuracy,
                "variants": {label: extra for label, extra in variants},
                "versions": {side.label: runs[side.label][0]["versions"] for side in trl_sides if runs[side.label]},
            },
            "runs": runs,
        },
    )


def figure_rows(
    runs: dict[str, list[dict]], steps: int, seeds: list[int], base_accuracy: Optional[float]
) -> list[dict]:
    """Rows per run label: s / step, trained tok/s, held-out accuracy (none when ``base_accuracy`` is None:
    not evaluated), each against the first TRL side run (TRL with its generate when run; ours' defaults when no
    TRL side ran), medians over seeds with their min..max as ``spread``."""
    trl_labels = [side.label for side in TRL_SIDES.values() if runs.get(side.label)]
    base_label = trl_labels[0] if trl_labels else next(iter(runs))
    scored = base_accuracy is not None
    stats = {
        label: {
            "step_s": median([summarize(r)["step_s"] for r in rs]),
            "tok_s": median([summarize(r)["tok_s"] for r in rs]),
            "accuracy": median([r["accuracy"] for r in rs]) if scored else None,
            "spreads": {k: spread([summarize(r)[k] for r in rs]) for k in ("step_s", "tok_s")}
            | {"accuracy": spread([r["accuracy"] for r in rs]) if scored else "—"},
            "tokens_per_step": median([summarize(r)["tokens_per_step"] for r in rs]),
        }
        for label, rs in runs.items()
        if rs
    }
    base = stats[base_label]
    out = []
    for label, s in stats.items():
        name = f"{label} ({steps} steps)"
        out.append(
            row(
                name,
                s["step_s"],
                "s / step (lower is better)",
                base_label,
                base["step_s"],
                spread=s["spreads"]["step_s"],
                tokens_per_step=s["tokens_per_step"],
            )
        )
        out.append(row(name, s["tok_s"], "trained tok/s", base_label, base["tok_s"], spread=s["spreads"]["tok_s"]))
        if scored:
            out.append(
                row(
                    name,
                    s["accuracy"],
                    f"held-out accuracy (base model {base_accuracy:.2f})",
                    base_label,
                    base["accuracy"],
                    spread=s["spreads"]["accuracy"],
                )
            )
    return out


if __name__ == "__main__":
    main()
