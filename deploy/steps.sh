# Sourced by deploy/quickstart.sh: a long setup step prints one line, its output goes to a log.
#
# step LOG LABEL CMD...: run CMD with its stdout and stderr appended to LOG, and print one
# line on stderr, "PREFIX: LABEL ... done (N s)" (PREFIX: $STEP_PREFIX, "quickstart"). When
# CMD fails, the line says so and names LOG, the last 20 lines of LOG follow, and step
# returns CMD's exit status.
step() {
    local log=$1 label=$2
    shift 2
    local start=$SECONDS status=0
    printf '%s: %s ... ' "${STEP_PREFIX:-quickstart}" "$label" >&2
    printf '\n==> %s: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >>"$log"
    "$@" >>"$log" 2>&1 </dev/null || status=$?
    if [ "$status" -eq 0 ]; then
        printf 'done (%d s)\n' "$((SECONDS - start))" >&2
        return 0
    fi
    printf 'failed (exit status %d after %d s); all of its output is in %s, the last lines:\n' \
        "$status" "$((SECONDS - start))" "$log" >&2
    tail -n 20 "$log" | sed 's/^/  /' >&2
    return "$status"
}
