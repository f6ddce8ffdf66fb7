#!/usr/bin/env bash
# The first run on a GPU, in about 10 minutes start-up included: each step under its own time budget, most
# valuable first, every result (or the reason a step could not run) written to gpu_report.md.
#
# Usage: bash scripts/gpu_check.sh [--dry-run] [REPORT]
#   --dry-run: list the steps and their budgets, run nothing.
#   PYTHON chooses the interpreter (default .venv/bin/python, else python3): it needs torch with CUDA and this
#   package's dependencies; nothing is installed or downloaded (the models are built locally).
# The exit status is 1 when a step failed or ran out of its budget, else 0 (skipped steps say why).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
REPORT=${1:-gpu_report.md}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

# step budget_s what it checks
STEPS=(
    "versions 20 torch / CUDA / NCCL / vLLM versions and the GPUs"
    "engine_devices 90 the embedded server on device auto, cuda and cuda:0 (health, a completion)"
    "sdpa_backends 30 which fused SDPA kernel each trainer attention call gets (none may need math)"
    "pytest_gpu 180 pytest -m gpu (engine exactness, CUDA graphs, trainer step, recipe, NCCL sync, vLLM)"
    "colocated_recipe 90 3 steps of async_rl_loop colocated on cuda:0 (versions, freed bytes, sync seconds, peak GB)"
    "graph_vs_eager 60 bf16 decode, CUDA graphs vs eager, on a Qwen2.5-1.5B-shaped model"
    "trainer_memory 60 trainer peak memory, shared-prompt packing and checkpointing on / off (1.5B shape)"
    "vllm_push 60 vLLM's CUDA build with the distributed weight push (when vLLM is installed)"
)
total=0
for s in "${STEPS[@]}"; do total=$((total + $(echo "$s" | cut -d' ' -f2))); done
if [ "$DRY" = 1 ]; then
    printf '%-18s %8s  %s\n' step budget what
    for s in "${STEPS[@]}"; do
        read -r name budget what <<<"$s"
        printf '%-18s %7ss  %s\n' "$name" "$budget" "$what"
    done
    echo "total: ${total}s of step budgets (interpreter: $PY)"
    exit 0
fi

status=0
{
    echo "# GPU check"
    echo
    echo "Commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), started $(date -u +%Y-%m-%dT%H:%M:%SZ), interpreter \`$PY\`."
    echo
} > "$REPORT"
for s in "${STEPS[@]}"; do
    read -r name budget what <<<"$s"
    echo "== $name (${budget}s): $what"
    start=$(date +%s)
    out=$(PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "$budget" "$PY" scripts/gpu_check.py "$name" 2>&1)
    rc=$?
    took=$(($(date +%s) - start))
    case $rc in
        0) verdict=$(grep -q '^skipped:' <<<"$out" && echo skipped || echo passed) ;;
        124) verdict="out of its ${budget}s budget"; status=1 ;;
        *) verdict="FAILED (exit $rc)"; status=1 ;;
    esac
    echo "   $verdict in ${took}s"
    {
        echo "## $name: $verdict (${took}s of ${budget}s)"
        echo
        echo "$what."
        echo
        if [ "$rc" = 0 ] || grep -q '^FAILED:' <<<"$out"; then
            grep -v '^\(Loading\|Writing\)' <<<"$out" | tail -60
        else
            echo '```'
            tail -40 <<<"$out"
            echo '```'
        fi
        echo
    } >> "$REPORT"
done
echo "report: $REPORT"
exit $status
