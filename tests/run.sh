#!/usr/bin/env bash
# The whole test suite, as root on a fresh Debian 12 machine: installs what is missing
# (deploy/install-dev.sh; a no-op when .ci/run has just run it), then runs three kinds of
# pass:
#
#   1. every cluster test on the last version of LLMD_TEST_SLURM_VERSIONS (default "22.05
#      24.11": on 24.11), once, on the machine's dev cluster;
#   2. beside it, one after the other: the `slurm_contract` tests (what Slurm itself says
#      or does) on every other version, each with a dev cluster of its own in network and
#      mount namespaces of its own (tests/beside.sh), so two clusters run at once; then
#      lint and types, and the tests that need no cluster, two at a time (pytest -n 2).
#      Their output is printed after the first pass's.
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
run_pass() { # NAME [tests/beside.sh RIG] PYTEST-ARGS... : runs one pass (through
    # tests/beside.sh when given), leaves "<summary>" and its rc in $work
    local name=$1 start=$SECONDS rc took line counts="$work/$1.counts" prefix=()
    shift
    if [ "${1:-}" = tests/beside.sh ]; then
        prefix=("$1" "$2")
        shift 2
    fi
    set +e
    LLMD_TEST_COUNTS=$counts "${prefix[@]}" .venv/bin/python -m pytest --durations=15 "$@"
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
beside=() # the passes run beside the first one, in order
for v in "${versions[@]}"; do
    [ "$v" = "$last" ] || beside+=("slurm_contract tests on Slurm $v")
done
beside+=("$fast")
# A dev cluster left up by an earlier command (deploy/quickstart.sh leaves its Slurm 22.05
# cluster up on purpose) is reused when it is what the cluster pass tests (Slurm $last,
# accounting on); otherwise it is taken down here, and we say so: the cluster pass would
# refuse it. The other versions' passes have clusters of their own (tests/beside.sh).
if deploy/devcluster/devcluster status --quiet >/dev/null 2>&1; then
    left=$(deploy/devcluster/devcluster env)
    left_version=$(sed -n "s/^export DEVCLUSTER_SLURM='\(.*\)'$/\1/p" <<<"$left")
    left_accounting=$(sed -n "s/^export DEVCLUSTER_ACCOUNTING='\(.*\)'$/\1/p" <<<"$left")
    if [ "$left_version" != "$last" ] || [ "$left_accounting" != 1 ]; then
        what="Slurm $left_version"
        [ "$left_accounting" = 1 ] || what="$what without accounting"
        echo "tests/run.sh: the dev cluster left up ($what) is not the one the cluster pass" \
            "tests (Slurm $last with accounting): taking it down first;" \
            "\`deploy/devcluster/devcluster up --slurm $left_version\` brings it back" >&2
        deploy/devcluster/devcluster down >&2
    fi
fi
echo "tests/run.sh: beside the cluster pass on Slurm $last: ${beside[*]} (their output comes after its)" >&2
{
    for v in "${versions[@]}"; do
        [ "$v" != "$last" ] || continue
        # Its own dev cluster, in namespaces of its own, with its own rig and pytest tmp.
        LLMD_TEST_SESSION_LIMIT_S=$(limit 900) run_pass "slurm_contract tests on Slurm $v" \
            tests/beside.sh "/var/tmp/llmd-devcluster-beside-$v" \
            -m "cluster and slurm_contract and not faults_full" --slurm-version "$v" \
            --basetemp="/tmp/llmd-tests-$v" "$@"
    done
    if lint; then
        LLMD_TEST_SESSION_LIMIT_S=$(limit 1200) run_pass "$fast" \
            -m "not cluster and not faults_full" -n 2 --basetemp=/tmp/llmd-tests-fast "$@"
    else
        echo "$fast: lint or types failed (above); the tests without the cluster did not run" \
            >"$work/$fast.summary"
        echo 1 >"$work/$fast.rc"
    fi
} >"$work/beside.log" 2>&1 &
beside_pid=$!
name="cluster tests on Slurm $last"
echo "tests/run.sh: $name" >&2
LLMD_TEST_SESSION_LIMIT_S=$(limit 1800) run_pass "$name" \
    -m "cluster and not faults_full" --slurm-version "$last" "$@"
record "$name"
wait "$beside_pid" || true
echo "tests/run.sh: ${beside[*]}" >&2
cat "$work/beside.log"
for name in "${beside[@]}"; do
    record "$name"
done
printf 'tests/run.sh: %s\n' "${summary[@]}" >&2
if [ "$status" -eq 0 ] && [ "$ran" -eq 0 ]; then
    status=5 # no pass ran a test
fi
exit "$status"
