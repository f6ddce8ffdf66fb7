# Sourced by .ci/run and .ci/periodic: `stage NAME COMMAND...` runs it and prints its wall time when it ends.
stage() {
    local name=$1 start
    shift
    start=$(date +%s)
    echo "=== stage: $name"
    "$@"
    echo "=== stage: $name: $(($(date +%s) - start)) s"
}
