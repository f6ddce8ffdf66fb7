#!/usr/bin/env bash
# Create .venv-clients: a separate venv with real agent frameworks from PyPI, for the tests that run
# them on their defaults through the training proxy (pytest -m clients, tests/proxy/test_clients.py):
# openai-agents, langchain-openai + langgraph, pydantic-ai (slim, with its openai extra), smolagents
# and litellm, at the versions below (checked to install together: pip check is clean).
#
# The frameworks run as agent processes of their own (tests/client_agents.py, an agent as a user
# writes it: it imports nothing from this project), pointed at the proxy that the tests start in
# .venv. So this venv holds the frameworks only: no torch, no copy of this package, and their
# requirements (openai, pydantic, httpx pins) never constrain this package's own. About 1.5 min from
# PyPI, ~550 MB.
#
# Idempotent: exits early when .venv-clients already has these versions and imports them.
# Usage: bash scripts/setup_clients.sh        (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-clients
PY=${PYTHON:-python3}
PACKAGES=(
    "openai-agents==0.24.0"
    "langchain-openai==1.7.4"
    "langgraph==1.2.24"
    "pydantic-ai-slim[openai]==2.68.0"
    "smolagents==1.26.0"
    "litellm==1.110.2"
)

check() {
    LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" - "${PACKAGES[@]}" <<'EOF2' 2>/dev/null
import importlib.metadata as md, sys
for spec in sys.argv[1:]:
    name, version = spec.split("==")
    name = name.split("[")[0]
    assert md.version(name) == version, (name, md.version(name))
import agents, langchain_openai, langgraph.graph, pydantic_ai, smolagents, litellm  # noqa: F401,E401  (the import is the check)
EOF2
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "$VENV is ready (${PACKAGES[*]})"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
pip_install() {  # a registry hiccup: pip keeps what it installed, so a retry fetches only the rest
    local attempt
    for attempt in 1 2 3; do
        $PIP install -q --retries 5 "$@" && return 0
        echo "setup_clients.sh: pip install $* failed (attempt $attempt of 3)" >&2
        [ "$attempt" = 3 ] || sleep $((attempt * 20))
    done
    return 1
}
pip_install --upgrade pip
pip_install "${PACKAGES[@]}"
if check; then
    echo "$VENV is ready (${PACKAGES[*]})"
else
    echo "setup_clients.sh: $VENV was built but the check failed; run: $VENV/bin/python -c 'import agents, langgraph, pydantic_ai, smolagents, litellm'" >&2
    exit 1
fi
