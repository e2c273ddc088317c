#!/usr/bin/env bash
# Quickstart on a fresh Debian 12 machine, as root: install what is missing, bring up the
# local dev Slurm cluster (4 nodes), start the supervisor daemon (its events go to a signed
# webhook receiver on loopback, deploy/webhook-receiver), submit the demo 2P+2D llm-d run
# (stand-in engines and benchmark), follow it to its verified outcome, print where its
# archive is, the benchmark's results table and the run.finished event the receiver got,
# and stop the daemon and the receiver again (the cluster stays up; stop it with
# `deploy/devcluster/devcluster down`). Exit status: the run's (0 only for succeeded).
#
#   deploy/quickstart.sh [--slurm 22.05|24.11] [--campaign]   (default 22.05, Debian 12's
#   Slurm; 24.11 runs from a Debian 13 root file system, built and cached on its first use)
#
# With --campaign it runs deploy/llm-d/campaign-demo.toml instead (12 points in 4 jobs,
# at most 2 at once), prints the aggregated table, then submits the same file again: every
# point is reused and no job runs. Exit status: the first campaign's (0: every point
# verified).
set -euo pipefail
SLURM=22.05
CAMPAIGN=
USAGE="usage: deploy/quickstart.sh [--slurm 22.05|24.11] [--campaign]"
while [ $# -gt 0 ]; do
    case "$1" in
        --slurm) SLURM="${2:-}"; shift 2 || shift ;;
        --slurm=*) SLURM="${1#--slurm=}"; shift ;;
        --campaign) CAMPAIGN=1; shift ;;
        *) echo "quickstart: unknown argument '$1'; $USAGE" >&2; exit 2 ;;
    esac
done
case "$SLURM" in
    22.05|24.11) ;;
    *) echo "quickstart: --slurm '$SLURM' is not a version the dev cluster runs; use 22.05 or 24.11" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
QS=/var/tmp/llmd-quickstart
mkdir -p "$QS"
# The setup's output (apt, pip, the cluster's start) goes to one file; one line per step here.
SETUP_LOG=$QS/setup.log
: >"$SETUP_LOG"
# shellcheck source=deploy/steps.sh
. deploy/steps.sh
echo "quickstart: the setup's full output goes to $SETUP_LOG" >&2
step "$SETUP_LOG" "installing what is missing (deploy/install-dev.sh)" deploy/install-dev.sh
step "$SETUP_LOG" "starting the Slurm $SLURM dev cluster" \
    deploy/devcluster/devcluster up --slurm "$SLURM"
eval "$(deploy/devcluster/devcluster env)"

# The events' destination: a Standard Webhooks receiver on loopback, with a fresh secret
# readable only by root (the daemon's account here). It appends what it verified to
# $QS/events.jsonl.
(umask 077 && printf 'whsec_%s\n' "$(head -c 32 /dev/urandom | base64)" >"$QS/webhook.whsec")
rm -f "$QS/webhook.port" "$QS/events.jsonl"
deploy/webhook-receiver --secret-file "$QS/webhook.whsec" --out "$QS/events.jsonl" \
    --port-file "$QS/webhook.port" 2>>"$QS/webhook.log" &
RECEIVER_PID=$!
DAEMON_PID=
stop_all() {
    if [ -n "$DAEMON_PID" ]; then kill -TERM "$DAEMON_PID" 2>/dev/null && wait "$DAEMON_PID" || true; fi
    kill -TERM "$RECEIVER_PID" 2>/dev/null && wait "$RECEIVER_PID" || true
}
trap stop_all EXIT
for _ in $(seq 50); do [ -s "$QS/webhook.port" ] && break; sleep 0.1; done
[ -s "$QS/webhook.port" ] || { echo "quickstart: the webhook receiver did not start; see $QS/webhook.log" >&2; exit 1; }
HOOK_PORT=$(cat "$QS/webhook.port")
cat > "$QS/config.toml" <<CONF
[daemon]
state_dir = "$QS/state"
socket = "$QS/control.sock"
log_format = "json"
log_roots = ["/var/tmp/llmd-runs"]  # the demo spec's log_dir is below it

[ssh]
user = "$DEVCLUSTER_SSH_USER"
identity_files = ["$DEVCLUSTER_SSH_KEY"]
known_hosts = "$DEVCLUSTER_KNOWN_HOSTS"

[[clusters]]
name = "dev"
slurm_conf = "$SLURM_CONF"

[dashboard]
url = "http://localhost:8080"  # what the ssh -L line below opens; events link their page

[[events.destination]]
name = "quickstart"
kind = "webhook"
url = "http://127.0.0.1:$HOOK_PORT/hooks/llmd"
secret_file = "$QS/webhook.whsec"
types = ["run.finished", "campaign.finished"]
CONF

.venv/bin/llmd-supervisor daemon --config "$QS/config.toml" >>"$QS/daemon.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 100); do
    [ -S "$QS/control.sock" ] && break
    kill -0 "$DAEMON_PID" 2>/dev/null || { echo "quickstart: the daemon died; see $QS/daemon.log" >&2; exit 1; }
    sleep 0.1
done
for _ in $(seq 50); do [ -S "$QS/web.sock" ] && break; sleep 0.1; done
echo "quickstart: the dashboard (read-only) listens on $QS/web.sock; from your workstation:" >&2
echo "  ssh -L 8080:$QS/web.sock $(hostname)    then open http://localhost:8080/" >&2
echo "  (here: curl --unix-socket $QS/web.sock http://localhost/)" >&2

received() { # TYPE: wait (30 s at most) for the receiver to get a TYPE event, and show it
    local i
    for i in $(seq 300); do
        grep -q "\"type\": \"$1\"" "$QS/events.jsonl" 2>/dev/null && break
        sleep 0.1
    done
    echo "quickstart: the webhook at 127.0.0.1:$HOOK_PORT received (signature verified; all of it in $QS/events.jsonl):" >&2
    .venv/bin/python - "$QS/events.jsonl" "$1" <<'PY' || echo "  no $1 event within 30 s; see $QS/daemon.log and .venv/bin/llmd-supervisor events list --socket $QS/control.sock" >&2
import json, sys
from pathlib import Path
path, kind = Path(sys.argv[1]), sys.argv[2]
lines = path.read_text().splitlines() if path.exists() else []
got = [json.loads(line) for line in lines if json.loads(line)["event"]["type"] == kind]
for line in got:
    data = line["event"]["data"]
    subject = data.get("run") or data.get("campaign") or {}
    print(f"  {kind} {line['webhook_id']}: {subject.get('name')} -> {data.get('outcome')}", file=sys.stderr)
sys.exit(0 if got else 1)
PY
}

if [ -n "$CAMPAIGN" ]; then
    FILE=deploy/llm-d/campaign-demo.toml
    echo "quickstart: the campaign $FILE (daemon log: $QS/daemon.log)" >&2
    .venv/bin/llmd-supervisor campaign submit "$FILE" --dry-run --socket "$QS/control.sock"
    set +e
    .venv/bin/llmd-supervisor campaign submit "$FILE" --wait --socket "$QS/control.sock"
    rc=$?
    set -e
    echo "quickstart: the same campaign again: every point verified above is reused" >&2
    .venv/bin/llmd-supervisor campaign submit "$FILE" --wait --socket "$QS/control.sock" || true
    received campaign.finished
    echo "quickstart: exit status $rc (0 = every point verified)" >&2
    exit "$rc"
fi
echo "quickstart: submitting deploy/llm-d/demo.toml (daemon log: $QS/daemon.log)" >&2
set +e
.venv/bin/llmd-supervisor submit deploy/llm-d/demo.toml --wait --follow --socket "$QS/control.sock"
rc=$?
set -e
# The run just followed is the newest one this daemon knows.
RUN=$(.venv/bin/llmd-supervisor list --all --json --socket "$QS/control.sock" |
      .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["runs"][-1]["run"])')
echo "quickstart: the benchmark's results (llmd-supervisor results $RUN):" >&2
.venv/bin/llmd-supervisor results "$RUN" --socket "$QS/control.sock" || true
received run.finished
echo "quickstart: the daemon stops now; the run stays readable from its archive:" >&2
echo "  .venv/bin/llmd-supervisor status $RUN --state-dir $QS/state" >&2
echo "  .venv/bin/llmd-supervisor results $RUN --state-dir $QS/state [--format inferencex-agg]" >&2
echo "  .venv/bin/llmd-supervisor report $RUN --state-dir $QS/state -o report.html" >&2
echo "quickstart: exit status $rc (0 = verified success)" >&2
exit "$rc"
