#!/usr/bin/env bash
# Benchmarks against the naive launcher loop on the real dev cluster (issue 7), as root.
#   tests/perf/run.sh            full mode (~20 min): writes tests/perf/report.{json,md}
#   tests/perf/run.sh --quick    short windows (~5 min)
#   tests/perf/run.sh --out /tmp/r --only rpc,end,cancel,resume,footprint
#   tests/perf/run.sh --campaign [--smoke]   the campaign benchmark, on the replayed
#                                            cluster (tests/perf/campaign.py; no dev cluster)
#   tests/perf/run.sh --team [--smoke]       a standby on a 100,000-run PostgreSQL journal
#                                            (tests/perf/team_journal.py; no dev cluster)
# Exit status: 0 when every measurement ran (missed targets included), 1 on harness errors.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=python
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ "${1:-}" = "--campaign" ]; then
    shift
    exec "$PY" -m tests.perf.campaign "$@"
fi
if [ "${1:-}" = "--team" ]; then
    shift
    exec "$PY" -m tests.perf.team_journal "$@"
fi
exec "$PY" -m tests.perf.bench "$@"
