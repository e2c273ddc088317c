#!/usr/bin/env bash
# Run a command (as root) with a dev cluster of its own beside the machine's: in a network
# namespace and a mount namespace of its own, where the dev cluster's bridge, addresses,
# ports, node namespaces (/run/netns) and /etc/hosts block are private, and with its own
# rig directory (DEVCLUSTER_RIG) and UTS namespace files (DEVCLUSTER_NSRUN: RIG's name
# under /run). tests/run.sh runs
# the slurm_contract pass of the older Slurm version this way, beside the newer version's
# whole cluster pass, so the two clusters run at the same time.
#
#   tests/beside.sh RIG COMMAND [ARG...]
#
# Loopback is up in the namespace; nothing else of the machine's network is reachable
# (the tests need nothing else). When COMMAND ends, the dev cluster of RIG is brought
# down (its processes would otherwise keep the namespaces alive, out of sight). Exit
# status: COMMAND's.
set -euo pipefail
if [ "${1:-}" != --inside ]; then
    [ $# -ge 2 ] || { echo "usage: tests/beside.sh RIG COMMAND [ARG...]" >&2; exit 2; }
    [ "$(id -u)" -eq 0 ] || { echo "tests/beside.sh: must run as root" >&2; exit 2; }
    mkdir -p /run/netns
    exec unshare --net --mount --propagation private -- "$0" --inside "$@"
fi
rig=$2
shift 2
cd "$(dirname "$0")/.."
mount -t tmpfs -o mode=0755 llmd-beside-netns /run/netns
hosts=$(mktemp /tmp/llmd-beside-hosts.XXXXXX)
cp /etc/hosts "$hosts"
chmod 0644 "$hosts"
mount --bind "$hosts" /etc/hosts
rm -f "$hosts" # the bind mount keeps it for this namespace
ip link set lo up
export DEVCLUSTER_RIG=$rig DEVCLUSTER_NSRUN="/run/$(basename "$rig")"
set +e
"$@"
rc=$?
set -e
if [ -f "$rig/state.json" ] && ! deploy/devcluster/devcluster down >&2; then
    [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
