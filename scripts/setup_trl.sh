#!/usr/bin/env bash
# Create .venv-trl: a separate venv with TRL (its GRPOTrainer is the baseline of the end_to_end
# benchmark, benchmarks/end_to_end.py, run through benchmarks/trl_grpo.py) so that TRL's
# requirements never constrain this package's own.
#
# torch is installed first as the CPU wheel torch==2.13.0 and then held there by a pip
# constraint for every later install, so nothing in TRL's dependency tree (accelerate,
# transformers, ...) can replace it with a multi-GB CUDA build. The check at the end fails
# if torch moved anyway.
#
# Idempotent: exits early when .venv-trl already imports trl $TRL_VERSION on torch 2.13.0.
# Usage: bash scripts/setup_trl.sh        (PYTHON=python3.11 to choose the interpreter;
#        TRL_VERSION=x.y.z to try another TRL)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-trl
TRL_VERSION=${TRL_VERSION:-1.16.0}
TORCH_VERSION=2.13.0
PY=${PYTHON:-python3}

check() {
    "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as md
assert md.version("trl") == "$TRL_VERSION", md.version("trl")
import torch
assert torch.__version__.startswith("$TORCH_VERSION"), torch.__version__
assert not torch.version.cuda, torch.version.cuda
from trl import GRPOConfig, GRPOTrainer  # noqa: F401  (the import is the check)
EOF
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "$VENV is ready (trl $TRL_VERSION, torch $TORCH_VERSION)"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
# A fresh venv downloads ~1.5 GB from PyPI (about 3 minutes on the shared machine). pip retries each
# download itself; a whole install that still fails (a registry hiccup) is tried again up to 3 times:
# pip keeps what it already installed, so a retry only fetches the rest.
pip_install() {
    local attempt
    for attempt in 1 2 3; do
        $PIP install -q --retries 5 "$@" && return 0
        echo "setup_trl.sh: pip install $* failed (attempt $attempt of 3)" >&2
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
pip_install -c "$CONSTRAINTS" "trl==$TRL_VERSION"
if check; then
    echo "$VENV is ready (trl $TRL_VERSION, torch $TORCH_VERSION)"
else
    echo "setup_trl.sh: $VENV was built but the check failed; run: $VENV/bin/python -c 'import trl, torch'" >&2
    exit 1
fi
