#!/usr/bin/env bash
# Install llmd-supervisor as a systemd service on a Slurm login node, as root, from this
# checkout. Safe to run again (it upgrades the package and keeps an existing config).
#
#   - creates the system user/group `llmd` (jobs are submitted as that user: it must be
#     known to Slurm with the same uid on every node and may SSH to its allocated nodes),
#   - creates /etc/llmd-supervisor, /var/lib/llmd-supervisor (journal, archives, ~/.ssh
#     with a fresh ed25519 key and an empty known_hosts),
#   - installs the package into a venv at /opt/llmd-supervisor and links the CLI to
#     /usr/local/bin/llmd-supervisor,
#   - installs systemd/llmd-supervisor.service into /etc/systemd/system and the default
#     config into /etc/llmd-supervisor/config.toml (an existing one is never overwritten),
#   - runs `systemctl daemon-reload` when systemd is running, and prints the next steps.
#
# Knobs (environment): PREFIX (venv, /opt/llmd-supervisor), LLMD_USER / LLMD_GROUP
# (llmd), PYTHON (python3, >= 3.11, with its venv module: Debian's python3-venv),
# LLMD_EXTRAS (the package's extras, comma-separated: "report" by default, matplotlib for
# `llmd-supervisor report`; "report,postgresql" adds the PostgreSQL journal's driver;
# empty for none), DESTDIR (install
# under a scratch root, for tests and packaging; then users are created only with
# LLMD_CREATE_USER=1 and systemd is left alone).
#
# install.sh --user: the per-user service instead, as yourself and without root. Jobs are
# then submitted as you (your Slurm associations, fair-share and quotas). It installs
# the package into ~/.local/share/llmd-supervisor/venv (PREFIX), links the CLI to
# ~/.local/bin, installs systemd/user/llmd-supervisor.service into
# ~/.config/systemd/user and writes ~/.config/llmd-supervisor/config.toml (socket
# $XDG_RUNTIME_DIR/llmd-supervisor/control.sock, mode 0600; state under
# $XDG_STATE_HOME/llmd-supervisor) unless one exists. Your own ~/.ssh reaches the nodes,
# or set access = "shared-fs" for a cluster whose nodes you cannot SSH to.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--user" ]; then
    exec bash "$SRC/deploy/install-user.sh"
elif [ -n "${1:-}" ]; then
    echo "install.sh: unknown argument ${1}; use no argument (the system service, as root) or --user" >&2
    exit 2
fi
DESTDIR=${DESTDIR:-}
PREFIX=${PREFIX:-/opt/llmd-supervisor}
LLMD_USER=${LLMD_USER:-llmd}
LLMD_GROUP=${LLMD_GROUP:-$LLMD_USER}
PYTHON=${PYTHON:-python3}
if [ -z "$DESTDIR" ]; then
    LLMD_CREATE_USER=${LLMD_CREATE_USER:-1}
else
    LLMD_CREATE_USER=${LLMD_CREATE_USER:-0}
fi
STATE=/var/lib/llmd-supervisor
ETC=/etc/llmd-supervisor
UNIT=/etc/systemd/system/llmd-supervisor.service

say() { echo "install.sh: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (it creates a system user and installs a service); as yourself: install.sh --user"
command -v "$PYTHON" >/dev/null 2>&1 \
    || die "$PYTHON is not installed (apt-get install python3 python3-venv), or set PYTHON=/path/to/python3.11"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is older than 3.11; set PYTHON=/path/to/python3.11"

# --- user and group -------------------------------------------------------------------
if [ "$LLMD_CREATE_USER" = 1 ]; then
    if ! getent group "$LLMD_GROUP" >/dev/null; then
        groupadd --system "$LLMD_GROUP"
        say "created group $LLMD_GROUP"
    fi
    if ! getent passwd "$LLMD_USER" >/dev/null; then
        # No password (locked); a shell, because the account runs commands over SSH on
        # the nodes and on remote login hosts.
        useradd --system --gid "$LLMD_GROUP" --home-dir "$STATE" --no-create-home \
            --shell /bin/bash --comment "llmd-supervisor service" "$LLMD_USER"
        say "created system user $LLMD_USER (home $STATE)"
    fi
fi
if getent passwd "$LLMD_USER" >/dev/null; then
    OWNER="$LLMD_USER:$LLMD_GROUP"
else
    OWNER=""
    say "user $LLMD_USER does not exist; files stay owned by root (DESTDIR install)"
fi
own() { if [ -n "$OWNER" ]; then chown "$@"; fi; }

# --- directories ----------------------------------------------------------------------
install -d -m 0755 "$DESTDIR$ETC"
install -d -m 0750 "$DESTDIR$STATE" "$DESTDIR$STATE/archive"
install -d -m 0700 "$DESTDIR$STATE/.ssh"
own "$OWNER" "$DESTDIR$STATE" "$DESTDIR$STATE/archive" "$DESTDIR$STATE/.ssh"
if [ ! -f "$DESTDIR$STATE/.ssh/id_ed25519" ]; then
    ssh-keygen -q -t ed25519 -N "" -C "$LLMD_USER@$(hostname)-llmd-supervisor" \
        -f "$DESTDIR$STATE/.ssh/id_ed25519"
    say "created the SSH key $STATE/.ssh/id_ed25519"
fi
touch "$DESTDIR$STATE/.ssh/known_hosts"
own "$OWNER" "$DESTDIR$STATE/.ssh/id_ed25519" "$DESTDIR$STATE/.ssh/id_ed25519.pub" \
    "$DESTDIR$STATE/.ssh/known_hosts"

# --- the package ----------------------------------------------------------------------
# shellcheck source=deploy/venv.sh
. "$SRC/deploy/venv.sh"
ensure_venv "$PYTHON" "$DESTDIR$PREFIX" \
    "apt-get install python3-venv, or set PYTHON=/path/to/a python3.11 that has them"
EXTRAS=${LLMD_EXTRAS-report}
"$DESTDIR$PREFIX/bin/python" -m pip install --quiet --disable-pip-version-check \
    --upgrade "$SRC${EXTRAS:+[$EXTRAS]}"
install -m 0644 "$SRC/README.md" "$DESTDIR$PREFIX/README.md"
install -d -m 0755 "$DESTDIR/usr/local/bin"
ln -sfn "$PREFIX/bin/llmd-supervisor" "$DESTDIR/usr/local/bin/llmd-supervisor"
VERSION=$("$DESTDIR$PREFIX/bin/llmd-supervisor" --version)
say "installed $VERSION into $PREFIX"

# --- unit and config ------------------------------------------------------------------
install -d -m 0755 "$DESTDIR$(dirname "$UNIT")"
sed -e "s#/opt/llmd-supervisor#$PREFIX#g" \
    -e "s#^User=.*#User=$LLMD_USER#" -e "s#^Group=.*#Group=$LLMD_GROUP#" \
    "$SRC/systemd/llmd-supervisor.service" >"$DESTDIR$UNIT.tmp"
chmod 0644 "$DESTDIR$UNIT.tmp"
mv -f "$DESTDIR$UNIT.tmp" "$DESTDIR$UNIT"
say "installed $UNIT"
if [ -e "$DESTDIR$ETC/config.toml" ]; then
    say "kept the existing $ETC/config.toml"
else
    install -m 0640 "$SRC/deploy/llmd-supervisor.toml" "$DESTDIR$ETC/config.toml"
    if [ -n "$OWNER" ]; then chgrp "$LLMD_GROUP" "$DESTDIR$ETC/config.toml"; fi
    say "installed the default $ETC/config.toml"
fi

if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    say "systemctl daemon-reload done"
else
    say "systemd is not running here (or DESTDIR is set): no daemon-reload"
fi

cat >&2 <<EOF

Next steps:
  1. Edit $ETC/config.toml: [[clusters]] (slurm_conf, login_host), [ssh], and
     daemon.log_roots (where run log directories may be; none until set), and add the
     same directories to the unit: systemctl edit llmd-supervisor ->
     [Service] ReadWritePaths=/your/shared/run/logs
  2. Let $LLMD_USER reach the nodes: authorize $STATE/.ssh/id_ed25519.pub for it on the
     nodes and collect their host keys: ssh-keyscan NODE... >> $STATE/.ssh/known_hosts
  3. Users who submit need the socket: set daemon.socket_group to their group (members
     may submit and see their own runs); daemon.admin_group may act on every run.
  4. llmd-supervisor config check --config $ETC/config.toml
  5. systemctl enable --now llmd-supervisor
     journalctl -u llmd-supervisor -o json      # its logs, one JSON event per line
EOF
