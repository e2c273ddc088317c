#!/usr/bin/env bash
# The whole test suite, as root on a fresh Debian 12 machine: installs what is missing
# (deploy/install-dev.sh; a no-op when .ci/run has just run it), then runs three kinds of
# pass:
#
#   1. lint and types, then the tests that need no cluster, once, two at a time (pytest
#      -n 2), beside the cluster passes (their tests mostly wait for Slurm; its output is
#      printed after them);
#   2. the `slurm_contract` tests (what Slurm itself says or does) on every Slurm version
#      of LLMD_TEST_SLURM_VERSIONS but the last (default "22.05 24.11": on 22.05);
#   3. every cluster test on the last version (24.11 by default), once.
#
# So with LLMD_TEST_SLURM_VERSIONS=22.05 the whole cluster suite runs once, on 22.05. Each
# cluster pass brings its version's cluster up and down; its test ids end in
# [slurm-<version>]. tests/conftest.py has the rule for the marker. Every pass prints how
# many tests it ran and how long it took. Extra arguments go to every pytest pass. Exit
# status: the first failing pass's.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-dev.sh
lint() {
    .venv/bin/ruff check llmd_supervisor tests &&
        .venv/bin/ruff format --check llmd_supervisor tests &&
        .venv/bin/mypy
}
VERSIONS=${LLMD_TEST_SLURM_VERSIONS:-22.05 24.11}
for v in $VERSIONS; do
    case "$v" in
        22.05|24.11) ;;
        *) echo "tests/run.sh: LLMD_TEST_SLURM_VERSIONS has '$v'; the dev cluster runs 22.05 and 24.11" >&2; exit 2 ;;
    esac
done
read -r -a versions <<<"$VERSIONS"
last=${versions[${#versions[@]}-1]}
status=0
ran=0
summary=()
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export LLMD_TEST_NO_SKIP=1 # a skip in CI is a missing component: a failure
run_pass() { # NAME PYTEST-ARGS... : runs one pass, leaves "<summary>" and its rc in $work
    local name=$1 start=$SECONDS rc took line counts="$work/$1.counts"
    shift
    set +e
    LLMD_TEST_COUNTS=$counts .venv/bin/python -m pytest --durations=15 "$@"
    rc=$?
    set -e
    took=$((SECONDS - start))
    line=$(tail -n 1 "$counts" 2>/dev/null || true)
    echo "$name: ${line:-no tests ran}; $((took / 60)) min $((took % 60)) s; pytest exit $rc" \
        >"$work/$name.summary"
    echo "$rc" >"$work/$name.rc"
}
record() { # NAME: add a finished pass to the summary and the exit status
    local rc
    rc=$(cat "$work/$1.rc")
    summary+=("$(cat "$work/$1.summary")")
    case $rc in
        0) ran=1 ;;
        5) ;; # nothing selected in this pass (extra arguments chose other tests)
        *) [ "$status" -ne 0 ] || status=$rc ;;
    esac
}
# Each pass's own limit (tests/conftest.py prints every stack and stops at it), so that
# all of them fit CI's 90 minutes. LLMD_TEST_SESSION_LIMIT_S set by the caller applies to each.
limit() { echo "${LLMD_TEST_SESSION_LIMIT_S:-$1}"; }
fast="lint, types and the tests without the cluster"
echo "tests/run.sh: $fast (beside the cluster passes; its output comes after theirs)" >&2
{
    if lint; then
        LLMD_TEST_SESSION_LIMIT_S=$(limit 1200) run_pass "$fast" \
            -m "not cluster and not faults_full" -n 2 --basetemp=/tmp/llmd-tests-fast "$@"
    else
        echo "$fast: lint or types failed (above); the tests without the cluster did not run" \
            >"$work/$fast.summary"
        echo 1 >"$work/$fast.rc"
    fi
} >"$work/fast.log" 2>&1 &
fast_pid=$!
for v in "${versions[@]}"; do
    if [ "$v" = "$last" ]; then
        name="cluster tests on Slurm $v"
        select=(-m "cluster and not faults_full")
        secs=1800
    else
        name="slurm_contract tests on Slurm $v"
        select=(-m "cluster and slurm_contract and not faults_full")
        secs=900
    fi
    echo "tests/run.sh: $name" >&2
    LLMD_TEST_SESSION_LIMIT_S=$(limit $secs) run_pass "$name" "${select[@]}" --slurm-version "$v" "$@"
    record "$name"
done
wait "$fast_pid" || true
echo "tests/run.sh: $fast" >&2
cat "$work/fast.log"
record "$fast"
printf 'tests/run.sh: %s\n' "${summary[@]}" >&2
if [ "$status" -eq 0 ] && [ "$ran" -eq 0 ]; then
    status=5 # no pass ran a test
fi
exit "$status"
