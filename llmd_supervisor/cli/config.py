"""`llmd-supervisor config check` and `config show`.

`check` validates the file as the daemon would and then looks at the machine: the files
the configuration names must exist (SSH identities and known_hosts, a local cluster's
slurm.conf, a webhook destination's secret file), the admin group must exist, and the
state directory's nearest existing parent must be a directory. Every problem is printed
as one line naming the key and the fix; the exit status is 0 when there is none, 2
otherwise.

`show` prints the effective configuration (defaults filled in) as TOML, or as JSON with
`--json`; its TOML output is itself a valid configuration file.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import sys
from pathlib import Path
from typing import Any

from llmd_supervisor.core.config import (
    DEFAULT_PATH,
    Access,
    ClusterConfig,
    Config,
    effective,
    read_config,
    to_toml,
)
from llmd_supervisor.core.journal.url import PostgresJournal
from llmd_supervisor.errors import ConfigError, ConfigErrors, SupervisorError, WebhookSecretError


def config_default() -> Path:
    """$LLMD_SUPERVISOR_CONFIG, else your own service's config when it exists
    (``$XDG_CONFIG_HOME/llmd-supervisor/config.toml``, written by install.sh --user), else
    the system one."""
    chosen = os.environ.get("LLMD_SUPERVISOR_CONFIG")
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    user = Path(base) / "llmd-supervisor" / "config.toml"
    return user if user.is_file() else DEFAULT_PATH


def add_parsers(sub: argparse._SubParsersAction[Any]) -> None:
    c = sub.add_parser("config", help="check or show the daemon configuration")
    csub = c.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    where = (
        "config TOML (default: $LLMD_SUPERVISOR_CONFIG, else"
        f" ~/.config/llmd-supervisor/config.toml when it exists, else {DEFAULT_PATH})"
    )
    p = csub.add_parser("check", help="validate the configuration file (exit 0 or 2)")
    p.add_argument("--config", type=Path, default=None, help=where)
    p.set_defaults(handler=cmd_check)
    p = csub.add_parser("show", help="print the effective configuration, defaults included")
    p.add_argument("--config", type=Path, default=None, help=where)
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(handler=cmd_show)


def environment_problems(config: Config) -> list[ConfigError]:
    """What on this machine keeps the configuration from working (files, groups)."""
    if all(c.access is Access.SHARED_FS for c in config.clusters):
        return _local_problems(config)  # no SSH at all: the [ssh] files are not used
    problems: list[ConfigError] = []
    for i, path in enumerate(config.ssh.identity_files):
        if not os.path.isfile(path):
            problems.append(
                ConfigError(
                    f"ssh.identity_files[{i}]",
                    path,
                    "no such file; create the key (ssh-keygen -t ed25519 -f PATH) or fix the path",
                )
            )
    kh = config.ssh.known_hosts
    if not os.path.isfile(kh):
        problems.append(
            ConfigError(
                "ssh.known_hosts",
                kh,
                "no such file; collect the nodes' host keys into it (ssh-keyscan) or fix the path",
            )
        )
    return problems + _local_problems(config)


def _local_problems(config: Config) -> list[ConfigError]:
    problems: list[ConfigError] = []
    for i, cluster in enumerate(config.clusters):
        conf = cluster.slurm_conf
        if conf is not None and cluster.login_host is None and not os.path.isfile(conf):
            problems.append(
                ConfigError(
                    f"clusters[{i}].slurm_conf",
                    conf,
                    "no such file on this machine; fix the path or remove the key "
                    "(a login_host cluster reads it on that host)",
                )
            )
    for key, group in (
        ("daemon.socket_group", config.socket_group),
        ("daemon.admin_group", config.admin_group),
    ):
        if group is None:
            continue
        try:
            grp.getgrnam(group)
        except KeyError:
            problems.append(
                ConfigError(key, group, "no such group; create it (groupadd) or remove the key")
            )
    if not config.log_roots:
        problems.append(
            ConfigError(
                "daemon.log_roots",
                [],
                "no run can be submitted until it lists the directories run log directories"
                " may be below, e.g. log_roots = ['/shared/llmd-runs']",
            )
        )
    for i, root in enumerate(config.log_roots):
        real = os.path.realpath(root)
        if real != root:
            problems.append(
                ConfigError(
                    f"daemon.log_roots[{i}]",
                    root,
                    f"it resolves to {real} (a symbolic link on its way); list {real} instead",
                )
            )
    # A root inside the state directory (or the archive) admits no run: the daemon refuses
    # log directories there (a job would write beside its journal). A root that holds the
    # state directory (a user's $HOME) is fine: that part of it is refused alone.
    for i, root in enumerate(config.log_roots):
        for key, own in (("state_dir", config.state_dir), ("archive_dir", config.archive_root)):
            if Path(root) == own or own in Path(root).parents:
                problems.append(
                    ConfigError(
                        f"daemon.log_roots[{i}]",
                        root,
                        f"it is inside daemon.{key} {str(own)!r}, where no run's log directory"
                        " may be (a job would write beside the daemon's own files); list a"
                        " directory apart from it",
                    )
                )
                break
    parent = config.state_dir
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        problems.append(
            ConfigError("daemon.state_dir", str(config.state_dir), f"{parent} is not a directory")
        )
    return problems


def _load(args: argparse.Namespace, command: str) -> tuple[Path, Config] | None:
    path: Path = args.config or config_default()
    try:
        return path, read_config(path)
    except ConfigErrors as many:  # one line each
        for problem in many.problems:
            print(f"llmd-supervisor config {command}: {path}: {problem}", file=sys.stderr)
    except SupervisorError as exc:
        print(f"llmd-supervisor config {command}: {path}: {exc}", file=sys.stderr)
    return None


def cmd_check(args: argparse.Namespace) -> int:
    loaded = _load(args, "check")
    if loaded is None:
        return 2
    path, config = loaded
    problems = (
        environment_problems(config)
        + secret_problems(config)
        + journal_problems(config)
        + start_problems(config)
    )
    for problem in problems:
        print(f"llmd-supervisor config check: {path}: {problem}", file=sys.stderr)
    if problems:
        return 2
    where = ", ".join(_access_text(c) for c in config.clusters)
    note = "" if path.exists() else " (no file: built-in defaults)"
    print(f"{path}: OK{note}; clusters: {where}")
    for warning in shared_fs_warnings(config):
        print(f"llmd-supervisor config check: {path}: warning: {warning}", file=sys.stderr)
    return 0


def start_problems(config: Config) -> list[ConfigError]:
    """What the daemon needs at start or to deliver that is not here: the dashboard's
    ``token_file`` (read at start when the dashboard listens on TCP), and the local
    ``sendmail`` of a mail destination."""
    problems: list[ConfigError] = []
    d = config.dashboard
    if d.enabled and d.tcp is not None and d.token_file is not None:
        from llmd_supervisor.supervision.web.dashboard import load_token  # the check's alone

        try:
            load_token(d, config.state_dir)
        except SupervisorError as exc:
            why = str(exc).rstrip(".") + "; the daemon would not start"
            problems.append(ConfigError("dashboard.token_file", d.token_file, why))
    from llmd_supervisor.adapters.outbox import sender as event_sender
    from llmd_supervisor.core.events.routing import DestinationKind

    sendmail = event_sender.SENDMAIL[0]
    if not os.access(sendmail, os.X_OK):
        for i, dest in enumerate(config.events.destinations):
            if dest.kind is DestinationKind.MAIL:
                problems.append(
                    ConfigError(
                        f"events.destination[{i}]",
                        dest.name,
                        f"a mail destination hands its mails to {sendmail}, which is not"
                        " installed here; install a mail transfer agent that provides it"
                        " (e.g. apt-get install msmtp-mta, or postfix) or remove the"
                        " destination",
                    )
                )
    return problems


def journal_problems(config: Config) -> list[ConfigError]:
    """The PostgreSQL journal's ``password_file``, if the daemon could not use it (as the
    daemon reads it: no link, a regular file of this account that others may not read)."""
    backend = config.journal
    if not isinstance(backend, PostgresJournal) or backend.password_file is None:
        return []
    from llmd_supervisor.adapters.journal.pg import read_password

    try:
        read_password(backend.password_file)
    except ConfigError as exc:
        return [exc]
    return []


def secret_problems(config: Config) -> list[ConfigError]:
    """Each webhook destination's ``secret_file`` that the daemon could not sign with (as
    the daemon reads it: no link, a regular file others may not read, whsec_ lines)."""
    # here, not at the top: every command's start would load the HTTP client (~0.1 s)
    from llmd_supervisor.adapters.outbox.sender import read_secret_file_now

    problems: list[ConfigError] = []
    for i, d in enumerate(config.events.destinations):
        if d.secret_file is None:
            continue
        try:
            read_secret_file_now(Path(d.secret_file))
        except WebhookSecretError as exc:
            why = exc.why if exc.line is None else f"line {exc.line}: {exc.why}"
            problems.append(ConfigError(f"events.destination[{i}].secret_file", d.secret_file, why))
    return problems


def _access_text(c: ClusterConfig) -> str:
    if c.access is Access.LOGIN_HOST:
        return f"{c.name} (access login-host: Slurm on {c.login_host}, logs over SSH per node)"
    if c.access is Access.SHARED_FS:
        return f"{c.name} (access shared-fs: Slurm here, logs from the shared file system, no SSH)"
    return f"{c.name} (access ssh: Slurm here, logs over SSH per node)"


def shared_fs_warnings(config: Config) -> list[str]:
    """What makes a shared-fs cluster unworkable here: a log root this machine does not
    see (the runs' files are only ever read locally in that mode)."""
    shared = [c.name for c in config.clusters if c.access is Access.SHARED_FS]
    if not shared:
        return []
    return [
        f"daemon.log_roots[{i}] {root!r} is not a directory here, and cluster"
        f" {', '.join(shared)} (access shared-fs) reads every run's files from it on this"
        " machine; mount the shared file system here or use access = 'ssh'"
        for i, root in enumerate(config.log_roots)
        if not os.path.isdir(root)
    ]


def cmd_show(args: argparse.Namespace) -> int:
    loaded = _load(args, "show")
    if loaded is None:
        return 2
    path, config = loaded
    tables = effective(config)
    if args.json:
        print(json.dumps(tables, indent=2))
    elif path.exists():
        sys.stdout.write(f"# effective configuration of {path}\n" + to_toml(tables))
    else:
        sys.stdout.write(
            f"# no configuration file at {path}: the built-in defaults (write them there"
            " to start one)\n" + to_toml(tables)
        )
    return 0
