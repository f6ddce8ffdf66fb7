#!/usr/bin/env bash
# Run the GPU suite (pytest -m gpu: tests/test_gpu.py and the other gpu-marked tests) and write a
# human-readable report: the machine (nvidia-smi), torch / CUDA / vLLM versions, and one line per
# test with its outcome and time. Without a GPU every test is skipped and the report says so.
#
# Usage: bash scripts/gpu_suite.sh [REPORT] [extra pytest args]
#   REPORT defaults to gpu_report.md; PYTHON chooses the interpreter (default .venv/bin/python,
#   else python3). The exit status is pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-gpu_report.md}
shift || true
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
XML=$(mktemp --suffix=.xml)
trap 'rm -f "$XML"' EXIT

start=$(date -u +%Y-%m-%dT%H:%M:%SZ)
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -m gpu -rs --junitxml="$XML" "$@"
status=$?

{
    echo "# GPU suite report"
    echo
    echo "Started $start, pytest exit status $status (\`pytest -m gpu\`, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))."
    echo
    echo "## Machine"
    echo
    echo '```'
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1
    else
        echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
    fi
    "$PY" - <<'PYEOF'
import importlib.util, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}, GPUs {torch.cuda.device_count()}")
if torch.cuda.is_available():
    print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for name in ("vllm", "sglang"):
    if importlib.util.find_spec(name):
        import importlib.metadata as md
        try:
            print(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"{name} (version unknown)")
    else:
        print(f"{name}: not installed")
PYEOF
    echo '```'
    echo
    echo "## Tests"
    echo
    "$PY" - "$XML" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
cases = root.iter("testcase")
counts = {}
print("| test | outcome | time (s) | detail |")
print("| --- | --- | --- | --- |")
for case in cases:
    outcome, detail = "passed", ""
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
            detail = (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""
            break
    counts[outcome] = counts.get(outcome, 0) + 1
    name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
    print(f"| `{name}` | {outcome} | {float(case.get('time', 0)):.1f} | {detail.replace('|', '/')} |")
print()
print("Totals: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
PYEOF
} > "$REPORT"
echo "report: $REPORT"
exit $status
