#!/usr/bin/env bash
# The fast pass (every test but the dev cluster's and the long fault runs) N times in a
# row while a CPU hog holds every core: a test that hopes something happened within a
# sleep instead of waiting on it goes red here first.
#
#   tests/hog.sh [N] [PYTEST-ARGS...]     N defaults to 5
#
# The hog is one busy shell loop per core (nproc), at nice 0 like the tests, started
# before the first run and stopped by PID at the end (or on ^C). Each run's result line
# and wall time are printed as it ends, then a summary; the exit status is 0 only when
# every run was green. Each run's full output is kept in /tmp/llmd-hog-logs/run-K.log.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
shift || true
case "$runs" in '' | *[!0-9]*)
    echo "tests/hog.sh: N must be a number of runs, got '$runs'" >&2
    exit 2
    ;;
esac
logs=/tmp/llmd-hog-logs
mkdir -p "$logs"
hogs=()
pytest_pid=
stop_hogs() {
    if [ -n "$pytest_pid" ]; then # interrupted mid-run: the run and its xdist workers
        workers=$(pgrep -P "$pytest_pid" || true)
        kill "$pytest_pid" $workers 2>/dev/null || true
        wait "$pytest_pid" 2>/dev/null || true
        pytest_pid=
    fi
    for pid in "${hogs[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${hogs[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    hogs=()
}
trap stop_hogs EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$(nproc)"); do
    nice -n 0 sh -c 'while :; do :; done' &
    hogs+=("$!")
done
echo "hog: ${#hogs[@]} busy loops (PIDs ${hogs[*]}) on $(nproc) cores"
green=0
results=()
for k in $(seq "$runs"); do
    start=$SECONDS
    set +e
    .venv/bin/python -m pytest -m "not cluster and not faults_full" -n 2 \
        --basetemp=/tmp/llmd-hog -q -p no:cacheprovider "$@" >"$logs/run-$k.log" 2>&1 &
    pytest_pid=$!
    wait "$pytest_pid"
    rc=$?
    pytest_pid=
    set -e
    took=$((SECONDS - start))
    line=$(grep -E '(passed|failed|error)' "$logs/run-$k.log" | tail -n 1)
    [ "$rc" -eq 0 ] && green=$((green + 1))
    results+=("run $k/$runs: exit $rc; $((took / 60)) min $((took % 60)) s; ${line}")
    echo "${results[-1]}"
    if [ "$rc" -ne 0 ]; then
        grep -E '^(FAILED|ERROR) ' "$logs/run-$k.log" | sed 's/^/    /' || true
    fi
done
stop_hogs
echo "hog: $green of $runs runs green (logs in $logs)"
[ "$green" -eq "$runs" ]
