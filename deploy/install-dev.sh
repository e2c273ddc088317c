#!/usr/bin/env bash
# Install what the dev cluster and the test suite need on a fresh Debian 12 machine, as root:
# the Debian packages (Slurm 22.05, munge, MariaDB, OpenSSH, iproute2, and debootstrap), the
# Debian 13 root file system of the Slurm 24.11 cluster (built once with debootstrap, cached
# under /var/cache/llmd-devcluster), chromium (the report test renders the HTML report
# headless), systemd-analyze (the unit files are checked with it), PostgreSQL 15 (the journal's
# tests run on it too), and the project with its dev and report extras in ./.venv.
#
# The one install path: .ci/run and tests/run.sh both run it. It leaves a stamp in .venv
# (the hash of what it installs from), so a second run in the same checkout is a no-op that
# says so; LLMD_INSTALL_FORCE=1 installs again anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
    echo "install-dev.sh: must run as root (it installs Debian packages)" >&2
    exit 1
fi
STAMP=.venv/.install-dev.stamp
inputs=$(cat deploy/install-dev.sh pyproject.toml deploy/devcluster/devcluster | sha256sum | cut -d' ' -f1)
if [ "${LLMD_INSTALL_FORCE:-0}" != 1 ] && [ -x .venv/bin/python ] && [ -f "$STAMP" ] &&
    [ "$(cat "$STAMP")" = "$inputs" ]; then
    echo "install-dev.sh: already installed in this checkout (stamp $STAMP matches); nothing to do" >&2
    exit 0
fi
start=$SECONDS
deploy/devcluster/devcluster install
deploy/devcluster/devcluster install --slurm 24.11 # its root file system, once per machine
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-dejavu-core)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
# The per-user install test runs install.sh --user with Debian's own python3 (a user
# cannot reach a root-owned pyenv): it needs its venv module.
/usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
# The journal's tests start a PostgreSQL 15 server of their own (tests/postgres.py).
[ -x /usr/lib/postgresql/15/bin/initdb ] || missing+=(postgresql)
# The two-login fault tests cut a login's link to the database with nftables (tests/ha_net.py).
command -v nft >/dev/null 2>&1 || missing+=(nftables)
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev,report]'
echo "$inputs" >"$STAMP"
echo "install-dev.sh: installed in $((SECONDS - start)) s" >&2
