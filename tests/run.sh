#!/usr/bin/env bash
# The whole test suite, as root on a fresh Debian 12 machine: installs what is missing,
# checks lint and types, runs the tests that need no cluster once, then the cluster tests
# (everything that uses the real dev cluster: its daemon and fault tests too) once per
# Slurm version in LLMD_TEST_SLURM_VERSIONS (default "22.05 24.11"; each pass brings its
# version's cluster up and down, and its test ids end in [slurm-<version>]).
# Extra arguments go to every pytest pass. Exit status: the first failing pass's.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-dev.sh
.venv/bin/ruff check llmd_supervisor tests
.venv/bin/mypy
VERSIONS=${LLMD_TEST_SLURM_VERSIONS:-22.05 24.11}
for v in $VERSIONS; do
    case "$v" in
        22.05|24.11) ;;
        *) echo "tests/run.sh: LLMD_TEST_SLURM_VERSIONS has '$v'; the dev cluster runs 22.05 and 24.11" >&2; exit 2 ;;
    esac
done
status=0
ran=0
summary=()
pass() { # NAME PYTEST-ARGS...
    local name=$1 rc
    shift
    echo "tests/run.sh: $name" >&2
    set +e
    .venv/bin/python -m pytest "$@"
    rc=$?
    set -e
    summary+=("$name: pytest exit $rc")
    case $rc in
        0) ran=1 ;;
        5) ;; # nothing selected in this pass (extra arguments chose other tests)
        *) [ "$status" -ne 0 ] || status=$rc ;;
    esac
}
# Each pass's own limit (tests/conftest.py prints every stack and stops at it), so that
# all of them fit CI's 90 minutes: measured ~2.5 min without the cluster and ~16 min of
# cluster tests per version. LLMD_TEST_SESSION_LIMIT_S set by the caller applies to each.
limit() { echo "${LLMD_TEST_SESSION_LIMIT_S:-$1}"; }
LLMD_TEST_SESSION_LIMIT_S=$(limit 1800) \
    pass "tests without the cluster" -m "not cluster and not faults_full" "$@"
for v in $VERSIONS; do
    deploy/devcluster/devcluster install --slurm "$v" # 24.11: its root file system, once
    LLMD_TEST_SESSION_LIMIT_S=$(limit 1500) \
        pass "cluster tests on Slurm $v" -m "cluster and not faults_full" --slurm-version "$v" "$@"
done
printf 'tests/run.sh: %s\n' "${summary[@]}" >&2
if [ "$status" -eq 0 ] && [ "$ran" -eq 0 ]; then
    status=5 # no pass ran a test
fi
exit "$status"
