"""``scripts/gpu_check.sh``: its dry run lists every step of ``scripts/gpu_check.py`` with a budget, within 10 minutes,
and on a machine without a GPU every step says why it did not run instead of failing."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def test_dry_run_lists_every_step_with_a_budget_within_ten_minutes():
    import gpu_check

    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    listed = re.findall(r"^(\w+)\s+(\d+)s\s", done.stdout, re.M)
    assert [name for name, _ in listed] == list(gpu_check.STEPS)  # same steps, same order
    total = int(re.search(r"total: (\d+)s", done.stdout).group(1))
    assert total == sum(int(b) for _, b in listed) <= 600


def test_a_step_that_cannot_run_says_why():
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "sdpa_backends"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.startswith("skipped: no CUDA device"), done.stdout + done.stderr
