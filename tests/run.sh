#!/usr/bin/env bash
# The whole test suite, as root on a fresh Debian 12 machine: installs what is missing,
# checks lint and types, then runs pytest (which brings the real dev cluster up and down).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-dev.sh
.venv/bin/ruff check llmd_supervisor tests
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
