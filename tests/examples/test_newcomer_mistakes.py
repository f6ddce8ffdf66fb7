"""A newcomer's mistakes on the default example end in one line naming the field and the fix, no traceback (issue #47).

Each test runs ``training/examples/rl/single_turn_token_in/train.py`` in a subprocess, as a user would: with a bad
``key=value`` override, or copied into ``tmp_path`` beside a small bad ``rollout.py``.
"""

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "training" / "examples" / "rl" / "single_turn_token_in"

pytestmark = pytest.mark.usefixtures("tiny_model_path")  # the example's process loads the tiny model's tokenizer


def run_example(cwd: Path, *overrides: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    return proc, time.perf_counter() - start


def last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    return lines[-1] if lines else ""


def assert_one_line(proc: subprocess.CompletedProcess, *parts: str) -> None:
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-4000:]
    line = last_line(proc)
    assert line.startswith("run stopped: "), proc.stderr[-2000:]
    for part in parts:
        assert part in line, line


def test_a_missing_data_file_and_a_log_path_that_cannot_be_made_are_one_line_each_within_10_s(tmp_path):
    missing = tmp_path / "missing.jsonl"
    proc, seconds = run_example(EXAMPLE, f"eval_rows={missing}", f"log_path={tmp_path / 'run'}")
    assert_one_line(proc, "eval_rows: no such file", str(missing))
    assert seconds < 10, f"reported after {seconds:.1f} s"
    proc, _ = run_example(EXAMPLE, "log_path=/proc/no/such/run", timeout=120)
    assert_one_line(proc, "log_path: cannot write", "set log_path=")


def test_a_base_model_typo_is_one_line_within_10_s_before_the_tokenizer_loads(tmp_path):
    proc, seconds = run_example(EXAMPLE, "base_model=tinyy", f"log_path={tmp_path / 'run'}")
    assert_one_line(proc, "base_model: 'tinyy'", "did you mean 'tiny'")
    assert seconds < 10, f"reported after {seconds:.1f} s"


def test_verifiers_local_without_verifiers_names_the_one_install_line():
    if importlib.util.find_spec("verifiers") is not None:
        pytest.skip("verifiers is installed: the example runs")
    proc, _ = run_example(EXAMPLE.parent / "verifiers_local", timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last_line(proc).endswith('pip install -e ".[verifiers]"'), proc.stderr[-2000:]


def test_debug_shows_the_traceback_of_a_user_error(tmp_path):
    proc, _ = run_example(EXAMPLE, "--debug", f"eval_rows={tmp_path / 'missing.jsonl'}", f"log_path={tmp_path}")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError: eval_rows" in proc.stderr


BAD_ROLLOUTS = {
    "plain_def": (
        "def make_rollout_fn(setup):\n    def rollout_fn(row):\n        return None\n    return rollout_fn\n",
        ("rollout_fn: rollout_fn is a plain `def`", "async def rollout_fn(row)"),
    ),
    "always_none": (
        "def make_rollout_fn(setup):\n    async def rollout_fn(row):\n        pass\n    return rollout_fn\n",
        ("rollout_fn returned None for all", "forgotten `return`"),
    ),
    "reward_none": (
        "from training.utils.rl.rollout import RolloutSample\n\n\ndef make_rollout_fn(setup):\n"
        "    async def rollout_fn(row):\n"
        "        return RolloutSample(tokens=[1, 2], logprobs=[0.0, 0.0], loss_mask=[0, 1], reward=None)\n"
        "    return rollout_fn\n",
        ("rollouts failed", "max_rollout_error_fraction"),
    ),
}


@pytest.mark.parametrize(  # each starts the tiny model's server: about 10 s
    "name", ["plain_def", "always_none", pytest.param("reward_none", marks=pytest.mark.slow)]
)
def test_a_bad_rollout_file_ends_the_run_in_one_line(tmp_path, name):
    source, parts = BAD_ROLLOUTS[name]
    for f in ("train.py", "data.jsonl", "eval.jsonl"):
        shutil.copy(EXAMPLE / f, tmp_path / f)
    (tmp_path / "rollout.py").write_text(source)
    proc, _ = run_example(tmp_path, f"log_path={tmp_path / 'run'}", "max_steps=2")
    assert_one_line(proc, *parts, "error.log")
    (log_path,) = [p for p in (tmp_path / "run").parent.glob("run*") if (p / "error.log").exists()]
    assert "Traceback" in (log_path / "error.log").read_text()
