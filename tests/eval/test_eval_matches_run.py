"""``python -m training.eval`` repeats a run's own eval figures: the same rows, rollout, sampling settings and seed
give the same rewards on the run's base model (its eval before step 0) and on its ``final/`` (its last eval)."""

import json
import subprocess
import sys
from pathlib import Path

from training.recipes import async_rl_loop
from training.recipes.single_turn import make_single_turn_rollout_fn
from training.utils import DeployConfig
from training.utils.metrics import read_metrics
from tests.recipes.test_recipes import config as recipes_config

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    {"prompt": p, "id": str(i)}
    for i, p in enumerate(
        ["1 + 1 =", "Hello", "The cat", "Once", "A B C", "Why", "Red", "Go", "x =", "Dear", "In", "So"]
    )
]


def score(completion: str, row: dict) -> float:
    return float(len(completion) % 3 == 0)


def test_eval_cli_gives_the_runs_eval_figures_on_its_base_and_final(tiny_model_path, tmp_path):
    (tmp_path / "reward.py").write_text("def score(completion, row):\n    return float(len(completion) % 3 == 0)\n")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = recipes_config(
        tiny_model_path,
        None,
        tmp_path,
        deployment=DeployConfig(),  # launched by the run, as python -m training.eval launches its own
        eval_rows=str(tmp_path / "rows.jsonl"),
        eval_interval=1,
        max_steps=1,
        max_tokens=8,
        temperature=1.0,
        seed=3,
        export_final_model=True,
    )
    async_rl_loop.main(cfg, rollout_fn_factory=make_single_turn_rollout_fn(score), rows=ROWS * 2)
    logged = [m["eval/reward_mean"] for m in read_metrics(cfg.log_path) if "eval/reward_mean" in m]
    assert len(logged) == 2
    args = ["--data", str(tmp_path / "rows.jsonl"), "--reward", f"{tmp_path / 'reward.py'}:score"]
    args += ["--temperature", "1.0", "--max-tokens", "8", "--seed", "3", "--out", str(tmp_path / "eval")]
    cmd = [sys.executable, "-m", "training.eval", tiny_model_path, "--compare", cfg.log_path, *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["summary"]["reward_mean"] == logged[0]  # the base model: the eval before step 0
    assert report["compare"]["summary"]["reward_mean"] == logged[1]  # final/: the eval after the last step
    assert 0 < logged[0] < 1  # a reward that varies, so equal means are not a coincidence of all-0 or all-1
