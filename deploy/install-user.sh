#!/usr/bin/env bash
# The per-user llmd-supervisor service, installed as yourself (no root): run it as
# `deploy/install.sh --user`. Safe to run again (it upgrades the package and keeps an
# existing config). Knobs (environment): PREFIX (the venv), PYTHON (python3, >= 3.11, with
# its venv module: Debian's python3-venv), LLMD_EXTRAS (as for install.sh: "report" by
# default; "report,postgresql" adds the PostgreSQL journal's driver), XDG_CONFIG_HOME,
# XDG_STATE_HOME, XDG_RUNTIME_DIR, XDG_DATA_HOME (the usual defaults).
set -euo pipefail

SRC=$(cd "$(dirname "$0")/.." && pwd)
say() { echo "install.sh --user: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" -ne 0 ] || die "run it as the user who will submit (root has the system service: install.sh)"
[ -n "${HOME:-}" ] && [ -d "$HOME" ] || die "HOME is not set to your home directory"
PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null 2>&1 \
    || die "$PYTHON is not installed (ask for python3 and python3-venv), or set PYTHON=/path/to/python3.11"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is older than 3.11; set PYTHON=/path/to/python3.11"
DATA=${XDG_DATA_HOME:-$HOME/.local/share}
CONF=${XDG_CONFIG_HOME:-$HOME/.config}
STATE=${XDG_STATE_HOME:-$HOME/.local/state}
RUNTIME=${XDG_RUNTIME_DIR:-/run/user/$(id -u)}
PREFIX=${PREFIX:-$DATA/llmd-supervisor/venv}
BIN=$HOME/.local/bin
UNIT=$CONF/systemd/user/llmd-supervisor.service
CONFIG=$CONF/llmd-supervisor/config.toml
umask 077

# --- the package ----------------------------------------------------------------------
[ -d "$(dirname "$PREFIX")" ] || install -d -m 0700 "$(dirname "$PREFIX")"
# shellcheck source=deploy/venv.sh
. "$SRC/deploy/venv.sh"
ensure_venv "$PYTHON" "$PREFIX" \
    "ask the machine's administrator to install python3-venv, or set PYTHON=/path/to/a python3.11 that has them"
EXTRAS=${LLMD_EXTRAS-report}
"$PREFIX/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade \
    "$SRC${EXTRAS:+[$EXTRAS]}"
install -m 0644 "$SRC/README.md" "$PREFIX/README.md"
install -d -m 0755 "$BIN"
ln -sfn "$PREFIX/bin/llmd-supervisor" "$BIN/llmd-supervisor"
say "installed $("$PREFIX/bin/llmd-supervisor" --version) into $PREFIX (CLI: $BIN/llmd-supervisor)"

# --- unit and config ------------------------------------------------------------------
install -d -m 0700 "$(dirname "$UNIT")" "$(dirname "$CONFIG")" "$STATE"
# The unit names the venv with %h (the home directory); a PREFIX elsewhere is spelt out.
sed -e "s#%h/.local/share/llmd-supervisor/venv#$PREFIX#g" \
    "$SRC/systemd/user/llmd-supervisor.service" >"$UNIT.tmp"
mv -f "$UNIT.tmp" "$UNIT"
say "installed $UNIT"
if [ -e "$CONFIG" ]; then
    say "kept the existing $CONFIG"
else
    cat >"$CONFIG.tmp" <<CONFIG
# llmd-supervisor for $(id -un): jobs are submitted as you. Check it with
# \`llmd-supervisor config check --config $CONFIG\`; unknown keys are errors.
[daemon]
state_dir = "$STATE/llmd-supervisor"                     # run journal and archives
socket = "$RUNTIME/llmd-supervisor/control.sock"       # systemd's RuntimeDirectory
socket_mode = "0600"                                    # only you
log_format = "json"
# Where your runs' log directories may be (run.log_dir below one of these); none until set.
# log_roots = ["/shared/$(id -un)/llmd-runs"]

[ssh]
# Your own key and known_hosts reach the allocated nodes (pam_slurm_adopt lets you in
# while you have a job there); with access = "shared-fs" no SSH is used at all.
# identity_files = ["$HOME/.ssh/id_ed25519"]
known_hosts = "$HOME/.ssh/known_hosts"

[[clusters]]
name = "default"
# slurm_conf = "/etc/slurm/slurm.conf"
# access = "shared-fs"          # no SSH to the nodes: read everything from the shared file system
CONFIG
    mv -f "$CONFIG.tmp" "$CONFIG"
    say "wrote $CONFIG"
fi

if [ -n "${XDG_RUNTIME_DIR:-}" ] && systemctl --user show-environment >/dev/null 2>&1; then
    systemctl --user daemon-reload
    say "systemctl --user daemon-reload done"
else
    say "no systemd user manager reachable here: no daemon-reload"
fi

cat >&2 <<EOF2

Next steps:
  1. Edit $CONFIG: daemon.log_roots (where your run log directories may be),
     [[clusters]] (slurm_conf; access = "shared-fs" if you cannot SSH to the nodes).
  2. llmd-supervisor config check --config $CONFIG
  3. systemctl --user enable --now llmd-supervisor
     loginctl enable-linger $(id -un)     # keep supervising after you log out
  4. llmd-supervisor submit SPEC.toml --wait    # the CLI finds your socket first
     journalctl --user -u llmd-supervisor -o json
EOF2
