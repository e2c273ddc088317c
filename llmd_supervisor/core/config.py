"""The daemon's configuration: one TOML file, validated, with effective defaults.

Every invalid value raises `ConfigError(key, value, hint)` naming the dotted key, the
value and the fix; unknown keys are errors (a typo must not silently fall back to a
default). Pure: takes TOML text, returns frozen dataclasses.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, TypeVar

from llmd_supervisor.core.events.routing import (
    Destination,
    DestinationKind,
    EventsConfig,
    parse_events,
    shown_proxy,
    shown_url,
)
from llmd_supervisor.core.journal.url import JournalBackend, SqliteJournal, parse_journal
from llmd_supervisor.core.spec.log_dirs import DEFAULT_SOCKET
from llmd_supervisor.errors import ConfigError, ConfigErrors

DEFAULT_PATH = Path("/etc/llmd-supervisor/config.toml")
DEFAULT_STATE_DIR = Path("/var/lib/llmd-supervisor")
# The most [limits] campaign_max_points may say: a campaign's points are held in memory
# while it expands (~13 KiB each: 100,000 are ~1.3 GiB, under the unit's MemoryMax).
CAMPAIGN_POINTS_MAX = 100_000


@dataclass(frozen=True)
class SshConfig:
    """How the daemon reaches allocated nodes (and a remote login node)."""

    user: str | None = None  # None: the user the daemon runs as
    identity_files: tuple[str, ...] = ()
    # Host keys are always verified; default: the daemon user's ~/.ssh/known_hosts.
    known_hosts: str = field(default_factory=lambda: default_known_hosts())
    port: int = 22
    connect_timeout_s: float = 10.0
    node_python: str = "python3"  # reads the job's files on nodes and login hosts


class Access(StrEnum):
    """How a cluster's run files (batch and per-rank logs, status files, marker) are reached."""

    SSH = "ssh"  # one SSH connection per allocated node; Slurm commands run here
    LOGIN_HOST = "login-host"  # Slurm commands and the marker through login_host, logs per node
    SHARED_FS = "shared-fs"  # no SSH: everything read here from the shared file system


@dataclass(frozen=True)
class ClusterConfig:
    """One Slurm cluster: where its client commands run and how its files are reached."""

    name: str
    slurm_conf: str | None = None  # exported as SLURM_CONF to the Slurm commands
    login_host: str | None = None  # run Slurm commands over SSH there instead of locally
    access: Access = Access.SSH  # default: login-host when login_host is set, else ssh


@dataclass(frozen=True)
class PollConfig:
    min_interval_s: float = 0.25  # while something changes
    max_interval_s: float = 5.0  # when idle; also capped below MinJobAge/2
    command_timeout_s: float = 30.0
    sacct_chunk: int = 200  # job ids per sacct call


@dataclass(frozen=True)
class Limits:
    verify_timeout_s: float = 120.0  # no believable terminal record by then: unverified
    node_silent_s: float = 60.0  # SSH heartbeat silence before a node is reported unreachable
    log_stall_s: float = 900.0  # no log growth for this long raises a `stalled` event
    heartbeat_interval_s: float = 2.0
    finish_drain_s: float = 10.0  # how long tailers may drain after the job left the queue
    archive_timeout_s: float = 60.0
    # Log copies stop here (a named event, never an outcome): per file, and per run.
    log_copy_max_bytes_per_file: int = 10 << 30
    log_copy_max_bytes_per_run: int = 20 << 30
    # A run's benchmark result files read at most (InferenceX and vLLM write one per
    # concurrency point; a sweep has a dozen), and the bytes of everything its archive
    # takes from the job (results, point logs, diagnostics); the rest is refused, named.
    result_files_max_per_run: int = 64
    result_bytes_max_per_run: int = 256 << 20
    # One result file's parse, in a child process: its address space, and its wall time.
    result_parse_memory_bytes: int = 512 << 20
    result_parse_timeout_s: float = 10.0
    # Node quarantine (core.run.retry_policy): the window failures count in, and how long they keep
    # a node out. Kept out of everyone's runs after `quarantine_after_failures` failures
    # the daemon saw itself (Slurm, SSH), or failures from `quarantine_after_inferred`
    # different runs of two or more owners; of one owner's runs after that owner's
    # failures from `quarantine_after_inferred` different runs.
    quarantine_ttl_s: float = 6 * 3600.0
    # A rank's agent still in a stage this long after the stage's own deadline is hung:
    # the attempt is ended early (TERM, grace, scancel) instead of at the time limit.
    stage_overdue_margin_s: float = 60.0
    quarantine_after_failures: int = 1
    quarantine_after_inferred: int = 2
    # A run held for want of nodes that are not excluded fails after this long (a spec's
    # `retry.hold_timeout_s` overrides it).
    hold_timeout_s: float = 1800.0
    # Points one campaign may expand to (a client's --max-points may ask for fewer, never
    # more): each is a run spec built and validated in memory, ~13 KiB and ~0.8 ms of CPU.
    campaign_max_points: int = 10_000
    # Campaign jobs one user may hold at once over all their campaigns of a cluster, and
    # their counted GPUs (None: no cap); the room under the account's submit limit is
    # shared among the users with campaign work, in turns (core.campaign.admission).
    per_user_max_jobs: int | None = None
    per_user_max_gpus: int | None = None


@dataclass(frozen=True)
class SocketLimits:
    """What one peer, and all of them, may hold of the control socket ([daemon] keys)."""

    max_connections: int = 512  # open client connections in all; more are refused
    max_connections_per_uid: int = 64
    max_streams_per_uid: int = 16  # concurrent `wait` / `logs --follow` requests per uid
    first_byte_timeout_s: float = 10.0  # a new connection must start its request by then
    request_timeout_s: float = 30.0  # a started request line must be complete by then
    idle_timeout_s: float = 120.0  # an open connection may sit between requests this long
    write_timeout_s: float = 60.0  # a client must take each reply line within this
    request_buffer_bytes: int = 64 << 20  # partial request lines held, in all
    request_buffer_bytes_per_uid: int = 8 << 20  # ... and per uid


@dataclass(frozen=True)
class WebLimits:
    """What one peer, and all of them, may hold of one HTTP listener (the dashboard's
    [dashboard] keys; the metrics endpoint keeps the defaults). A peer is a uid on a Unix
    socket, a source address on TCP; each listener has its own caps."""

    max_connections: int = 256  # open connections per listener; more get 503 and are closed
    max_connections_per_peer: int = 64
    head_timeout_s: float = 10.0  # a request head must be whole this long after it may start
    max_streams: int = 64  # live log streams per listener
    max_streams_per_viewer: int = 16  # ... and per viewer (a uid; a token holder's address)


@dataclass(frozen=True)
class DashboardConfig:
    """The read-only web dashboard ([dashboard]): a Unix socket, and optionally loopback TCP."""

    enabled: bool = True
    socket: Path | None = None  # default: web.sock beside the control socket
    socket_mode: int | None = None  # default: the control socket's mode (and its group)
    tcp: str | None = None  # host:port on loopback, e.g. 127.0.0.1:8765 (token required)
    # The TCP token: a file readable only by the service account (None: one is made at
    # start in <state_dir>/dashboard.token, 0600, and its path is logged).
    token_file: str | None = None
    # Host header names accepted on TCP besides localhost, 127.0.0.1 and ::1 (any port).
    hosts: tuple[str, ...] = ()
    # Where people open the dashboard (e.g. http://localhost:8080 after `ssh -L`): outbound
    # events link a run's or campaign's page under it (None: events carry no such link).
    url: str | None = None
    limits: WebLimits = field(default_factory=WebLimits)

    def page(self, path: str) -> str | None:
        """The link to the dashboard's page `path` ("/runs/ID"), if `url` is set."""
        return None if self.url is None else f"{self.url}{path}"


@dataclass(frozen=True)
class Config:
    state_dir: Path = DEFAULT_STATE_DIR
    archive_dir: Path | None = None  # default: <state_dir>/archive
    socket_path: Path = DEFAULT_SOCKET
    socket_mode: int = 0o600  # default: 0660 with a socket_group, else 0600 (only us)
    socket_group: str | None = None  # who may connect (submit, see their own runs)
    admin_group: str | None = None  # who may also see and cancel everyone's runs
    log_format: str = "auto"  # auto | json | console
    ssh: SshConfig = field(default_factory=SshConfig)
    poll: PollConfig = field(default_factory=PollConfig)
    limits: Limits = field(default_factory=Limits)
    clusters: tuple[ClusterConfig, ...] = (ClusterConfig(name="default"),)
    metrics_listen: str | None = None  # host:port on loopback, e.g. 127.0.0.1:9464
    socket_limits: SocketLimits = field(default_factory=SocketLimits)
    # Run log directories must lie under one of these (canonical, absolute) directories.
    log_roots: tuple[str, ...] = ()
    # Where outbound events go ([[events.destination]]; core.events.routing).
    events: EventsConfig = field(default_factory=EventsConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)

    @property
    def dashboard_socket(self) -> Path:
        """The dashboard's Unix socket: as configured, else web.sock beside the control socket."""
        d = self.dashboard.socket
        return d if d is not None else self.socket_path.parent / "web.sock"

    # Which journal ([journal]; core.journal.url): SQLite in state_dir unless a url is set.
    journal: JournalBackend = field(default_factory=SqliteJournal)

    @property
    def archive_root(self) -> Path:
        return self.archive_dir if self.archive_dir is not None else self.state_dir / "archive"

    @property
    def journal_path(self) -> Path:
        return self.state_dir / "journal.sqlite3"

    def cluster(self, name: str | None) -> ClusterConfig:
        """The named cluster, or the first one when `name` is None."""
        if name is None:
            return self.clusters[0]
        for c in self.clusters:
            if c.name == name:
                return c
        known = ", ".join(c.name for c in self.clusters)
        raise ConfigError("clusters", name, f"no cluster of that name is configured ({known})")


def _access(c: Mapping[str, object], key: str, login_host: str | None) -> Access:
    raw = c.get("access", Access.LOGIN_HOST.value if login_host else Access.SSH.value)
    choices = "'ssh', 'login-host' or 'shared-fs'"
    try:
        access = Access(raw if isinstance(raw, str) else "")
    except ValueError:
        raise ConfigError(f"{key}.access", raw, f"use {choices}") from None
    if access is Access.LOGIN_HOST and login_host is None:
        raise ConfigError(
            f"{key}.access", raw, "'login-host' needs login_host (the host to run Slurm on)"
        )
    if access is not Access.LOGIN_HOST and login_host is not None:
        raise ConfigError(
            f"{key}.access",
            raw,
            f"login_host {login_host!r} is only used with access = 'login-host'; remove one",
        )
    return access


def load_config(text: str, source: str = "the configuration") -> Config:
    """Parse and validate the TOML text of a config file (`source`: its path, for
    messages). ConfigErrors lists every problem found, not only the first."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            "(TOML syntax)", source, f"{exc}; fix the syntax at that line of {source}"
        ) from None
    return parse_config(data)


def read_config(path: Path) -> Config:
    """Read and validate a config file; a missing file at the default path means defaults."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if path == DEFAULT_PATH:
            return Config()
        raise ConfigError(
            "--config", str(path), "the file does not exist; create it or pass --config PATH"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise ConfigError("--config", str(path), f"it cannot be read ({why})") from None
    return load_config(text, str(path))


def default_known_hosts() -> str:
    """~/.ssh/known_hosts of the user the daemon runs as (systemd sets HOME for User=)."""
    return os.path.expanduser("~/.ssh/known_hosts")


_TOP = (
    "daemon",
    "ssh",
    "poll",
    "limits",
    "clusters",
    "metrics",
    "events",
    "dashboard",
    "journal",
)
_DAEMON_KEYS = (
    "state_dir",
    "archive_dir",
    "socket",
    "socket_mode",
    "socket_group",
    "admin_group",
    "log_format",
    "log_roots",
    *SocketLimits.__dataclass_fields__,
)
T = TypeVar("T")


class _Problems:
    """Every problem of a config file: each check runs, a failed one gives its default."""

    def __init__(self) -> None:
        self.found: list[ConfigError] = []

    def check(self, parse: Callable[[], T], default: T) -> T:
        try:
            return parse()
        except ConfigErrors as many:
            self.found += many.problems
        except ConfigError as exc:
            self.found.append(exc)
        return default


def parse_config(data: Mapping[str, object]) -> Config:
    """Validate a decoded config; ConfigErrors with every problem when there is one."""
    found = _Problems()
    found.check(lambda: _keys("", data, _TOP), None)
    empty: Mapping[str, object] = {}
    d = found.check(lambda: _table(data, "daemon"), empty)
    found.check(lambda: _keys("daemon", d, _DAEMON_KEYS), None)
    state_dir = found.check(lambda: _abs_path(d, "daemon.state_dir", DEFAULT_STATE_DIR), None)
    socket_path = found.check(lambda: _abs_path(d, "daemon.socket", DEFAULT_SOCKET), None)
    archive = found.check(lambda: _abs_path(d, "daemon.archive_dir", None), None)
    no_roots: tuple[str, ...] = ()
    log_roots = found.check(lambda: _log_roots(d), no_roots)
    log_format = found.check(lambda: _log_format(d), "auto")
    group = found.check(lambda: _opt_str(d, "daemon.socket_group"), None)
    mode = found.check(lambda: _socket_mode(d, group), 0o600)
    admin_group = found.check(lambda: _opt_str(d, "daemon.admin_group"), None)
    socket_limits = found.check(lambda: _socket_limits(d), SocketLimits())
    ssh = found.check(lambda: _ssh(_table(data, "ssh")), None)
    poll = found.check(lambda: _poll(_table(data, "poll")), PollConfig())
    limits = found.check(lambda: _limits(_table(data, "limits")), Limits())
    no_clusters: tuple[ClusterConfig, ...] = ()
    clusters = found.check(lambda: _clusters(data), no_clusters)
    listen = found.check(lambda: _metrics(_table(data, "metrics")), None)
    events = found.check(lambda: parse_events(_table(data, "events")), EventsConfig())
    dashboard = found.check(lambda: _dashboard(_table(data, "dashboard")), DashboardConfig())
    sqlite: JournalBackend = SqliteJournal()
    journal = found.check(lambda: parse_journal(_table(data, "journal")), sqlite)
    if found.found:
        raise ConfigErrors(found.found)
    assert state_dir is not None and socket_path is not None and ssh is not None
    return Config(
        state_dir=state_dir,
        archive_dir=archive,
        socket_path=socket_path,
        socket_mode=mode,
        socket_group=group,
        admin_group=admin_group,
        log_format=log_format,
        ssh=ssh,
        poll=poll,
        limits=limits,
        clusters=clusters,
        metrics_listen=listen,
        socket_limits=socket_limits,
        log_roots=log_roots,
        events=events,
        dashboard=dashboard,
        journal=journal,
    )


# An absolute example per path key, for the sentence refusing a relative one.
_PATH_EXAMPLES: Final[Mapping[str, str]] = {
    "daemon.state_dir": str(DEFAULT_STATE_DIR),
    "daemon.socket": str(DEFAULT_SOCKET),
    "daemon.archive_dir": f"{DEFAULT_STATE_DIR}/archive",
    "dashboard.token_file": "/etc/llmd-supervisor/dashboard.token",
    "dashboard.socket": "/run/llmd-supervisor/web.sock",
}


def _abs_path(d: Mapping[str, object], key: str, default: Path | None) -> Path | None:
    raw = _opt_str(d, key)
    if raw is None:
        return default
    if not raw.startswith("/"):
        example = _PATH_EXAMPLES.get(key, "/srv/llmd/" + raw.lstrip("./"))
        raise ConfigError(
            key,
            raw,
            f"{key} = {raw!r} is a relative path, and the daemon would resolve it against its"
            " own working directory (not yours, not the configuration file's); write an"
            f" absolute path, e.g. {key} = {example!r}",
        )
    return Path(raw)


def _log_roots(d: Mapping[str, object]) -> tuple[str, ...]:
    log_roots = _str_list(d, "daemon.log_roots")
    for root in log_roots:
        if not root.startswith("/") or os.path.normpath(root) != root.rstrip("/") or root == "/":
            raise ConfigError(
                "daemon.log_roots",
                root,
                "list absolute directories without '..', '.' or a trailing '/', not '/'"
                " itself, e.g. ['/shared/llmd-runs']",
            )
    return tuple(r.rstrip("/") for r in log_roots)


def _log_format(d: Mapping[str, object]) -> str:
    log_format = _str(d, "daemon.log_format", "auto")
    if log_format not in ("auto", "json", "console"):
        raise ConfigError("daemon.log_format", log_format, "use auto, json or console")
    return log_format


def _socket_mode(
    d: Mapping[str, object], group: str | None, key: str = "daemon.socket_mode"
) -> int:
    # Without a group the socket is the daemon's user's alone: group rights would go to
    # the primary group of whoever started it.
    mode_text = _str(d, key, "0600" if group is None else "0660")
    try:
        mode = int(mode_text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777 or mode & 0o007:
        raise ConfigError(
            key,
            mode_text,
            "use an octal mode without rights for others, e.g. 0660",
        )
    return mode


def _ssh(s: Mapping[str, object]) -> SshConfig:
    _keys(
        "ssh",
        s,
        ("user", "identity_files", "known_hosts", "port", "connect_timeout_s", "node_python"),
    )
    ssh = SshConfig(
        user=_opt_str(s, "ssh.user"),
        identity_files=_str_list(s, "ssh.identity_files"),
        known_hosts=_opt_str(s, "ssh.known_hosts") or default_known_hosts(),
        port=_int(s, "ssh.port", 22, 1, 65535),
        connect_timeout_s=_num(s, "ssh.connect_timeout_s", 10.0, 0.5, 300),
        node_python=_str(s, "ssh.node_python", "python3"),
    )
    if (
        not ssh.node_python
        or ssh.node_python.startswith("-")
        or any(c.isspace() for c in ssh.node_python)
    ):
        raise ConfigError(
            "ssh.node_python",
            ssh.node_python,
            "name an interpreter like 'python3' or '/usr/bin/python3'",
        )
    return ssh


def _poll(p: Mapping[str, object]) -> PollConfig:
    _keys("poll", p, ("min_interval_s", "max_interval_s", "command_timeout_s", "sacct_chunk"))
    poll = PollConfig(
        min_interval_s=_num(p, "poll.min_interval_s", 0.25, 0.05, 60),
        max_interval_s=_num(p, "poll.max_interval_s", 5.0, 0.1, 600),
        command_timeout_s=_num(p, "poll.command_timeout_s", 30.0, 1, 600),
        sacct_chunk=_int(p, "poll.sacct_chunk", 200, 1, 5000),
    )
    if poll.max_interval_s < poll.min_interval_s:
        raise ConfigError(
            "poll.max_interval_s", poll.max_interval_s, "it must not be below poll.min_interval_s"
        )
    return poll


_PER_USER: Final = ("per_user_max_jobs", "per_user_max_gpus")


def _limits(lim: Mapping[str, object]) -> Limits:
    names = tuple(Limits.__dataclass_fields__)
    _keys("limits", lim, names)
    defaults = Limits()
    sizes: tuple[str, ...] = ("log_copy_max_bytes_per_file", "log_copy_max_bytes_per_run")
    sizes += ("result_bytes_max_per_run", "result_parse_memory_bytes")
    counts: tuple[str, ...]
    counts = ("quarantine_after_failures", "quarantine_after_inferred")
    counts += ("result_files_max_per_run",)
    values: dict[str, Any] = {
        n: _num(lim, f"limits.{n}", float(getattr(defaults, n)), 0.1, 86400)
        for n in names
        if n not in (*sizes, *counts, "campaign_max_points", *_PER_USER)
    }
    for n in _PER_USER:  # absent: no cap
        values[n] = _int(lim, f"limits.{n}", 0, 1, 100_000) if n in lim else None
    for n in counts:
        values[n] = _int(lim, f"limits.{n}", getattr(defaults, n), 1, 1000)
    for n in sizes:
        values[n] = _int(lim, f"limits.{n}", getattr(defaults, n), 1 << 20, 1 << 50)
    values["campaign_max_points"] = _int(
        lim, "limits.campaign_max_points", defaults.campaign_max_points, 1, CAMPAIGN_POINTS_MAX
    )
    return Limits(**values)


def _clusters(data: Mapping[str, object]) -> tuple[ClusterConfig, ...]:
    clusters_raw = data.get("clusters", [{"name": "default"}])
    if not isinstance(clusters_raw, list) or not clusters_raw:
        raise ConfigError("clusters", clusters_raw, "use one or more [[clusters]] tables")
    clusters = []
    for i, c in enumerate(clusters_raw):
        key = f"clusters[{i}]"
        if not isinstance(c, dict):
            raise ConfigError(key, c, "each [[clusters]] entry must be a table")
        _keys(key, c, ("name", "slurm_conf", "login_host", "access"))
        name = _str(c, f"{key}.name", "")
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"{key}.name", name, "use letters, digits, - and _")
        login_host = _opt_str(c, f"{key}.login_host")
        clusters.append(
            ClusterConfig(
                name=name,
                slurm_conf=_opt_str(c, f"{key}.slurm_conf"),
                login_host=login_host,
                access=_access(c, key, login_host),
            )
        )
    if len({c.name for c in clusters}) != len(clusters):
        raise ConfigError("clusters", [c.name for c in clusters], "cluster names must be unique")
    return tuple(clusters)


def _metrics(m: Mapping[str, object]) -> str | None:
    _keys("metrics", m, ("listen",))
    return _loopback(m, "metrics.listen", "127.0.0.1:9464")


def _loopback(t: Mapping[str, object], key: str, example: str) -> str | None:
    """A loopback host:port (None when unset)."""
    listen = _opt_str(t, key)
    if listen is not None:
        host, _, port = listen.rpartition(":")
        if (
            host not in ("127.0.0.1", "localhost", "[::1]")
            or not port.isdigit()
            or not 1 <= int(port) <= 65535
        ):
            raise ConfigError(
                key,
                listen,
                f"use a loopback host:port with a port from 1 to 65535, e.g. {example}",
            )
    return listen


_DASHBOARD_KEYS = (
    "enabled",
    "socket",
    "socket_mode",
    "tcp",
    "token_file",
    "hosts",
    "url",
    *WebLimits.__dataclass_fields__,
)
_URL_MAX = 200


def _dashboard(t: Mapping[str, object]) -> DashboardConfig:
    _keys("dashboard", t, _DASHBOARD_KEYS)
    enabled = t.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError("dashboard.enabled", enabled, "use true or false")
    mode = None
    if "socket_mode" in t:
        mode = _socket_mode({"socket_mode": t["socket_mode"]}, None, "dashboard.socket_mode")
    token_file = _abs_path(t, "dashboard.token_file", None)
    hosts = _str_list(t, "dashboard.hosts")
    for host in hosts:
        if not host.replace("-", "").replace(".", "").isalnum():
            raise ConfigError(
                "dashboard.hosts",
                host,
                "list host names without a port, e.g. ['login1.example.org']",
            )
    return DashboardConfig(
        enabled=enabled,
        socket=_abs_path(t, "dashboard.socket", None),
        socket_mode=mode,
        tcp=_loopback(t, "dashboard.tcp", "127.0.0.1:8765"),
        token_file=None if token_file is None else str(token_file),
        hosts=tuple(h.lower() for h in hosts),
        url=_dashboard_url(t),
        limits=_web_limits(t),
    )


def _web_limits(t: Mapping[str, object]) -> WebLimits:
    """The dashboard listeners' connection and stream caps and their head timeout."""
    base = WebLimits()

    def count(n: str) -> int:
        return _int(t, f"dashboard.{n}", getattr(base, n), 1, 1 << 16)

    return WebLimits(
        max_connections=count("max_connections"),
        max_connections_per_peer=count("max_connections_per_peer"),
        head_timeout_s=_num(t, "dashboard.head_timeout_s", base.head_timeout_s, 0.1, 3600),
        max_streams=count("max_streams"),
        max_streams_per_viewer=count("max_streams_per_viewer"),
    )


def _dashboard_url(t: Mapping[str, object]) -> str | None:
    """The dashboard's base URL as people open it (http or https, no query or fragment)."""
    url = _opt_str(t, "dashboard.url")
    if url is None:
        return None
    scheme, sep, rest = url.partition("://")
    if (
        not sep
        or scheme not in ("http", "https")
        or not rest
        or len(url) > _URL_MAX
        or any(c in url for c in '?#"\n\r\t <>')
    ):
        raise ConfigError(
            "dashboard.url",
            url,
            "give the address people open the dashboard at, with no query or fragment, "
            "e.g. 'http://localhost:8080' (after ssh -L 8080:<web.sock> <login node>)",
        )
    return url.rstrip("/")


def _socket_limits(d: Mapping[str, object]) -> SocketLimits:
    """The [daemon] connection caps, timeouts and buffer budgets."""
    base = SocketLimits()

    def count(n: str) -> int:
        return _int(d, f"daemon.{n}", getattr(base, n), 1, 1 << 20)

    def seconds(n: str) -> float:
        return _num(d, f"daemon.{n}", getattr(base, n), 0.1, 86400)

    def size(n: str) -> int:  # a whole 1 MiB request line must fit in a uid's share
        return _int(d, f"daemon.{n}", getattr(base, n), 2 << 20, 1 << 34)

    return SocketLimits(
        max_connections=count("max_connections"),
        max_connections_per_uid=count("max_connections_per_uid"),
        max_streams_per_uid=count("max_streams_per_uid"),
        first_byte_timeout_s=seconds("first_byte_timeout_s"),
        request_timeout_s=seconds("request_timeout_s"),
        idle_timeout_s=seconds("idle_timeout_s"),
        write_timeout_s=seconds("write_timeout_s"),
        request_buffer_bytes=size("request_buffer_bytes"),
        request_buffer_bytes_per_uid=size("request_buffer_bytes_per_uid"),
    )


def _keys(prefix: str, table: Mapping[str, object], allowed: tuple[str, ...]) -> None:
    for key in table:
        if key not in allowed:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(where, table[key], f"unknown key; allowed here: {', '.join(allowed)}")


def _table(data: Mapping[str, object], name: str) -> Mapping[str, object]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(name, value, f"[{name}] must be a table")
    return value


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _str(t: Mapping[str, object], key: str, default: str) -> str:
    value = t.get(_leaf(key), default)
    if not isinstance(value, str):
        raise ConfigError(key, value, "use a string")
    return value


def _opt_str(t: Mapping[str, object], key: str) -> str | None:
    value = t.get(_leaf(key))
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, "use a non-empty string")
    return value


def _str_list(t: Mapping[str, object], key: str) -> tuple[str, ...]:
    value = t.get(_leaf(key), [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(key, value, "use a list of non-empty strings")
    return tuple(value)


def _int(t: Mapping[str, object], key: str, default: int, lo: int, hi: int) -> int:
    value = t.get(_leaf(key), default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(key, value, f"use an integer from {lo} to {hi}")
    return value


def _num(t: Mapping[str, object], key: str, default: float, lo: float, hi: float) -> float:
    value = t.get(_leaf(key), default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ConfigError(key, value, f"use a number of seconds from {lo:g} to {hi:g}")
    return float(value)


def effective(config: Config) -> dict[str, object]:
    """The effective configuration in the file's own layout (defaults filled in).

    Unset optional keys are None. `load_config(to_toml(effective(c)))` equals `c`, except
    that an unset `daemon.archive_dir` and `dashboard.socket` are shown as their effective
    values.
    """
    return {
        "daemon": {
            "state_dir": str(config.state_dir),
            "archive_dir": str(config.archive_root),
            "socket": str(config.socket_path),
            "socket_mode": f"{config.socket_mode:04o}",
            "socket_group": config.socket_group,
            "admin_group": config.admin_group,
            "log_format": config.log_format,
            "log_roots": list(config.log_roots),
            **{n: getattr(config.socket_limits, n) for n in SocketLimits.__dataclass_fields__},
        },
        "ssh": {
            "user": config.ssh.user,
            "identity_files": list(config.ssh.identity_files),
            "known_hosts": config.ssh.known_hosts,
            "port": config.ssh.port,
            "connect_timeout_s": config.ssh.connect_timeout_s,
            "node_python": config.ssh.node_python,
        },
        "poll": {
            "min_interval_s": config.poll.min_interval_s,
            "max_interval_s": config.poll.max_interval_s,
            "command_timeout_s": config.poll.command_timeout_s,
            "sacct_chunk": config.poll.sacct_chunk,
        },
        "limits": {n: getattr(config.limits, n) for n in Limits.__dataclass_fields__},
        "metrics": {"listen": config.metrics_listen},
        "dashboard": {
            "enabled": config.dashboard.enabled,
            "socket": str(config.dashboard_socket),
            "socket_mode": None
            if config.dashboard.socket_mode is None
            else f"{config.dashboard.socket_mode:04o}",
            "tcp": config.dashboard.tcp,
            "token_file": config.dashboard.token_file,
            "hosts": list(config.dashboard.hosts),
            "url": config.dashboard.url,
            **{n: getattr(config.dashboard.limits, n) for n in WebLimits.__dataclass_fields__},
        },
        "clusters": [
            {
                "name": c.name,
                "slurm_conf": c.slurm_conf,
                "login_host": c.login_host,
                "access": c.access.value,
            }
            for c in config.clusters
        ],
        # The proxy without its user or password; None: the environment's (HTTPS_PROXY, ...).
        "events": {
            "proxy": None if config.events.proxy is None else shown_proxy(config.events.proxy)
        },
        # Rendered as [[events.destination]] tables; a URL shown without its path (a
        # Slack webhook's path is its credential).
        "events.destination": [_destination(d) for d in config.events.destinations],
        "journal": _journal(config.journal),
    }


def _journal(backend: JournalBackend) -> dict[str, object]:
    if isinstance(backend, SqliteJournal):
        return {"url": None, "password_file": None}
    return {"url": backend.url, "password_file": backend.password_file}


def _destination(d: Destination) -> dict[str, object]:
    shown: dict[str, object] = {"name": d.name, "kind": d.kind.value}
    if d.kind is DestinationKind.MAIL:
        shown["to"] = list(d.to)
        shown["from"] = d.sender
    else:
        shown["url"] = shown_url(d.url or "")
        if d.kind is DestinationKind.WEBHOOK:
            shown["secret_file"] = d.secret_file
    shown["types"] = sorted(t.value for t in d.types)
    shown["owners"] = list(d.owners)
    shown["opt_in"] = d.opt_in
    return shown


def to_toml(tables: Mapping[str, object]) -> str:
    """Render `effective()`'s shape as TOML; None values become comments ("not set")."""
    out: list[str] = []

    def body(table: Mapping[str, object]) -> None:
        for key, value in table.items():
            if value is None:
                out.append(f"# {key} is not set")
            else:
                out.append(f"{key} = {_toml_value(value)}")

    for name, value in tables.items():
        if isinstance(value, list):
            for entry in value:
                assert isinstance(entry, Mapping)
                out.append(f"\n[[{name}]]")
                body(entry)
        else:
            assert isinstance(value, Mapping)
            out.append(f"\n[{name}]")
            body(value)
    return "\n".join(out).lstrip("\n") + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # A JSON string is a valid TOML basic string for everything a config holds.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {value!r} as TOML")
