#!/usr/bin/env bash
# The tests at the dependency floors (after scripts/setup_floor.sh): the tests of every part that calls the floor
# packages' APIs (transformers, tokenizers, safetensors, aiohttp, numpy): server, sampler, proxy, trainer, agents,
# envs, rewards, utils, and the recipe loops' own tests (tests/recipes/test_recipes.py). Left to the main run:
# the examples' and benchmarks' end-to-end runs and the other recipe scenarios (fault matrix, resume, exit, first
# hour: the same library calls as the tests kept, at many times their cost), and the engine's kernel tests
# (tests/deployment/engine: torch alone, whose floor is the version the main run has). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ignores=(--ignore=tests/examples --ignore=tests/benchmarks --ignore=tests/deployment/engine)
for f in tests/recipes/test_*.py; do
    [ "$f" = tests/recipes/test_recipes.py ] || ignores+=("--ignore=$f")
done
exec .venv-floor/bin/python -m pytest "${ignores[@]}" "$@"
