"""The TRL baseline of ``benchmarks.end_to_end`` (``pytest -m trl``; skipped without ``.venv-trl``).

Needs ``.venv-trl`` from ``bash scripts/setup_trl.sh`` (about 3 minutes from PyPI, 1.5 GB). Runs TRL's
``GRPOTrainer`` on the tiny model for one step through the harness, as the benchmark does.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.end_to_end import EXAMPLE, TRL_PYTHON, TRL_SCRIPT, chat_prompts, example_config, harness_overrides

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.trl,
    pytest.mark.skipif(not TRL_PYTHON.exists(), reason=f"no TRL venv at {TRL_PYTHON}: run bash scripts/setup_trl.sh"),
]


def test_trl_baseline_trains_one_step_on_torch_2_13_cpu_and_its_model_is_scored():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.end_to_end", "--quick", "--sides", "ours,trl"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])
    trl = result["runs"]["TRL GRPOTrainer"][0]
    assert len(trl["step_s"]) == len(trl["tokens"]) == 1 and trl["step_s"][0] > 0 and trl["tokens"][0] > 0
    assert trl["versions"]["torch"] == "2.13.0+cpu"  # nothing in TRL's tree replaced the CPU wheel
    assert 0.0 <= trl["accuracy"] <= 1.0
    assert {r["baseline"] for r in result["rows"]} == {"TRL GRPOTrainer"}
    assert result["settings"]["trl"]["learning_rate"] == 1e-5


def test_trl_generates_from_the_prompt_ids_our_example_sends(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from benchmarks.end_to_end import trl_settings

    cfg, rollout = example_config(harness_overrides(tiny_model_path, 1, 0, str(tmp_path / "probe")))
    out = subprocess.run(
        [
            str(TRL_PYTHON),
            str(TRL_SCRIPT),
            "--model",
            tiny_model_path,
            "--rows",
            str(EXAMPLE / "data.jsonl"),
            "--out",
            str(tmp_path / "trl"),
            "--prompt-ids",
            "--settings",
            json.dumps(trl_settings(cfg, longest_prompt=80)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ids = json.loads([l for l in out.stdout.splitlines() if l.startswith('{"')][-1])["prompt_ids"]
    rows = [json.loads(l) for l in (EXAMPLE / "data.jsonl").open()][: cfg.prompt_groups_per_step]
    assert ids == chat_prompts(AutoTokenizer.from_pretrained(tiny_model_path), rows, rollout.INSTRUCTION)
