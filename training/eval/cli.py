"""``python -m training.eval``: evaluate a model on a task; optionally compare it with a second model.

    python -m training.eval MODEL --data eval.jsonl [--reward mod:fn | --rollout rollout.py:make_rollout_fn]
    python -m training.eval --run runs/x --step 10 --data eval.jsonl --reward rewards.py:score
    python -m training.eval MODEL --reasoning-gym chain_sum --size 50
    ... [--n 8] [--k 1,4,8] [--seed 0] [--out DIR] [--compare MODEL2]

The arguments are checked before anything loads: a missing file, an unknown model or a ``module:function``
that does not import is one line on stderr and exit code 2. Then each model is served and scored in turn
(``runner.py``), the table printed, and with ``--out`` the report written (``report.py``: ``eval.json``,
``eval.csv``).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

from training.eval.tasks import EvalArgumentError

PROG = "python -m training.eval"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """argparse's own refusals (an unknown option, ``--n abc``) as one line too, exit code 2."""
        print(f"{PROG}: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Evaluate a model on a task: pass@k and mean reward.")
    p.add_argument(
        "model",
        nargs="?",
        help="a model folder, a hub id, a run's log_path (its final/ folder) or <log_path>@STEP (a checkpoint)",
    )
    p.add_argument("--run", help="a run's log_path (the same as giving it as MODEL)")
    p.add_argument("--step", type=int, help="with a run: evaluate its checkpoint of this step instead of final/")
    task = p.add_argument_group("task (one of --data, --reasoning-gym)")
    task.add_argument(
        "--data", help="a .jsonl file of rows (messages, prompt_token_ids or prompt; plus what the reward reads)"
    )
    task.add_argument("--reward", help="module:function or path.py:function, called reward(completion_text, row)")
    task.add_argument("--rollout", help="module:make_rollout_fn or rollout.py:make_rollout_fn: the rows go through it")
    task.add_argument("--reasoning-gym", dest="reasoning_gym", metavar="NAME", help="a reasoning-gym dataset name")
    task.add_argument("--size", type=int, default=50, help="reasoning-gym: entries (default 50)")
    task.add_argument("--data-seed", type=int, default=0, help="reasoning-gym: the dataset's seed (default 0)")
    task.add_argument("--limit", type=int, help="evaluate only the first LIMIT rows")
    s = p.add_argument_group("sampling")
    s.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    s.add_argument("--k", help="comma-separated k for pass@k, each <= n (default 1, 2, 4, ... n)")
    s.add_argument("--seed", type=int, default=0, help="request seeds derive from it (default 0)")
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--max-concurrency", type=int, default=64, help="rollouts in flight (default 64, a run's)")
    s.add_argument(
        "--timeout-s", type=float, default=600.0, help="a rollout past it scores 0 (failed; default 600, a run's)"
    )
    s.add_argument("--device", default="auto", help="the engine's device: auto, cpu, cuda, cuda:N")
    s.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--compare", metavar="MODEL2", help="a second model (same forms as MODEL), same prompts and seeds")
    p.add_argument("--out", help="a folder for eval.json and eval.csv (and the servers' logs)")
    return p


def parse_ks(text: Optional[str], n: int) -> list[int]:
    from training.eval.report import default_ks

    if text is None:
        return default_ks(n)
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise EvalArgumentError(f"--k: comma-separated integers, got {text!r}") from None
    bad = [k for k in ks if not 1 <= k <= n]
    if not ks or bad:
        raise EvalArgumentError(f"--k: each k must be in [1, n={n}], got {text!r}")
    return ks


def check_args(args: argparse.Namespace):
    """Everything that can be refused before a model loads: the targets, the task, the settings."""
    from training.eval.models import resolve_target
    from training.eval.runner import EvalSettings
    from training.eval.tasks import jsonl_task, reasoning_gym_task

    if args.run and args.model:
        raise EvalArgumentError("MODEL, --run: give one")
    spec = args.run or args.model
    if not spec:
        raise EvalArgumentError("MODEL: give a model folder, a hub id or a run (--run LOG_PATH [--step N])")
    if args.n < 1:
        raise EvalArgumentError(f"--n: must be >= 1, got {args.n}")
    ks = parse_ks(args.k, args.n)
    if (args.data is None) == (args.reasoning_gym is None):
        raise EvalArgumentError("--data, --reasoning-gym: give one task")
    if args.reasoning_gym is not None and (args.reward or args.rollout):
        raise EvalArgumentError("--reward, --rollout: a reasoning-gym task is scored by the library")
    if args.limit is not None and args.limit < 1:
        raise EvalArgumentError(f"--limit: must be >= 1, got {args.limit}")
    targets = [resolve_target(spec, args.step, "MODEL" if args.model else "--run")]
    if args.compare:
        targets.append(resolve_target(args.compare, None, "--compare"))
    if args.data is not None:
        task = jsonl_task(args.data, args.reward, args.rollout)
    else:
        task = reasoning_gym_task(args.reasoning_gym, args.size, args.data_seed)
    if args.limit is not None:
        task.rows = task.rows[: args.limit]
        task.describe["rows"] = len(task.rows)
    settings = EvalSettings(
        n=args.n,
        seed=args.seed,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout_s,
        device=args.device,
        max_model_len=args.max_model_len,
    )
    return targets, task, settings, ks


def run(args: argparse.Namespace) -> dict:
    from training.eval import report as rep
    from training.eval.runner import evaluate_model

    targets, task, settings, ks = check_args(args)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="training-eval-"))
    try:
        scores = [evaluate_model(t, task, settings, work, label) for t, label in zip(targets, "ab")]
    finally:
        for label in "ab":  # a checkpoint's exported weights are not part of the report
            shutil.rmtree(work / f"weights-{label}", ignore_errors=True)
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "model": targets[0].describe(),
        "task": task.describe,
        "settings": {**settings.describe(), "k": ks},
        "summary": rep.summarize(scores[0], ks),
        "prompts": rep.per_prompt(scores[0], task.rows),
    }
    if len(scores) == 2:
        result["compare"] = {
            "model": targets[1].describe(),
            "summary": rep.summarize(scores[1], ks),
            "prompts": rep.per_prompt(scores[1], task.rows),
            "difference": rep.compare(scores[0], scores[1]),
        }
    print(rep.table(result))
    if args.out:
        json_path, csv_path = rep.write_report(result, Path(args.out))
        print(f"wrote {json_path} and {csv_path}")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from training.deployment.backends.process import DeploymentStartError

    try:
        run(args)
    except EvalArgumentError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except DeploymentStartError as e:
        print(f"{PROG}: the server did not start: {e.summary}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
