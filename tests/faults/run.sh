#!/usr/bin/env bash
# The whole fault-injection suite on the real dev cluster (as root), including the long
# members that CI leaves out (`faults_full`: 200 concurrent runs). CI runs the rest as
# part of tests/run.sh: crash points (8 x 3 runs), slurmdbd/slurmctld/link/sshd faults,
# a full archive disk, late and garbage markers, and the control-socket fuzz
# (tests/unit/test_control_fuzz.py, 2,000+ messages).
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/install-dev.sh
exec .venv/bin/python -m pytest tests/faults tests/unit/test_control_fuzz.py -m "" "$@"
