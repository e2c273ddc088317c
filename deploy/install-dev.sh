#!/usr/bin/env bash
# Install what the dev cluster and the test suite need on a fresh Debian 12 machine, as root:
# the Debian packages (Slurm 22.05, munge, MariaDB, OpenSSH, iproute2, and debootstrap, which
# builds the Debian 13 root file system of the Slurm 24.11 cluster on its first
# `devcluster up --slurm 24.11`) and the project with its dev and report extras in ./.venv,
# and chromium (the report test renders the HTML report headless). Safe to run again; a
# no-op when everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
    echo "install-dev.sh: must run as root (it installs Debian packages)" >&2
    exit 1
fi
deploy/devcluster/devcluster install
if ! command -v chromium >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core
fi
# The per-user install test runs install.sh --user with Debian's own python3 (a user
# cannot reach a root-owned pyenv): it needs its venv module.
if ! /usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev,report]'
