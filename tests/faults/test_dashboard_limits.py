"""Hostile peers against the real daemon's dashboard (issue 4.1): connections that never
finish their request head are capped per peer (per uid on web.sock, per source address on
loopback TCP) and per listener, and closed at the head timeout, while everyone else is
served; every query parameter a page reads answers 400 to a hostile value, never 500 and
never with a traceback in the log.

The hostile Unix-socket peer is a throwaway system user (`tests.strangers`) running
tests/faults/web_peer.py under setpriv with the system python3; TCP peers come from other
loopback addresses (127.0.0.0/8 is all this machine's).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from llmd_supervisor.core.config import DashboardConfig, load_config
from tests.browser import free_port
from tests.daemon_helpers import Daemon
from tests.fakes.replay_world import ReplayWorld
from tests.faults.test_socket_limits import daemon_for, finished_run, journal_runs
from tests.strangers import Stranger
from tests.unit.test_dashboard import running_run

pytestmark = pytest.mark.timeout(180)

WEB_PEER = Path(__file__).with_name("web_peer.py")
TOKEN = "dashboard-test-token-" + "x" * 24


def dashboard_daemon(root: Path, stranger: Stranger, keys: str = "") -> tuple[Daemon, int]:
    """A daemon (no cluster behind it) whose web.sock the stranger may use, with the
    dashboard on loopback TCP too (its token in a file); `keys`: more [dashboard] keys."""
    port = free_port()
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    d = daemon_for(root, stranger)
    d.extra_config = f'[dashboard]\ntcp = "127.0.0.1:{port}"\ntoken_file = "{token_file}"\n{keys}\n'
    return d, port


def get(
    address: Path | tuple[str, int],
    target: str,
    *,
    source: str | None = None,
    token: bool = True,
    timeout: float = 20,
) -> tuple[int, bytes]:
    """One GET (on TCP from `source`, with the token's cookie); its status and body."""
    if isinstance(address, Path):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if source is not None:
            s.bind((source, 0))
    with s:
        s.settimeout(timeout)
        s.connect(str(address) if isinstance(address, Path) else address)
        cookie = f"Cookie: llmd_dashboard={TOKEN}\r\n" if token else ""
        request = f"GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        s.sendall(f"{request}{cookie}\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@contextmanager
def holding(
    argv_prefix: list[str], address: str, n: int, refused: int, hold_s: float, *extra: str
) -> Iterator[tuple[subprocess.Popen[str], dict[str, object]]]:
    """web_peer.py holding `n` unfinished request heads; its first report."""
    argv = [*argv_prefix, str(WEB_PEER), "hold", address, str(n), str(refused), str(hold_s)]
    proc = subprocess.Popen([*argv, *extra], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        yield proc, first
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def last_report(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    report = json.loads(proc.stdout.readline())
    proc.wait(timeout=30)
    assert isinstance(report, dict)
    return report


def as_stranger(stranger: Stranger) -> list[str]:
    return [
        "setpriv",
        f"--reuid={stranger.uid}",
        f"--regid={stranger.gid}",
        "--clear-groups",
        "/usr/bin/python3",
    ]


# ----------------------------------------------------------------------------- lock-out


def test_300_unfinished_heads_on_web_sock_lock_out_no_one_and_are_closed_at_the_timeout(
    root_dir: Path, stranger: Stranger
) -> None:
    d, port = dashboard_daemon(root_dir, stranger, "head_timeout_s = 8")
    d.start()
    web = root_dir / "web.sock"
    per_peer = DashboardConfig().limits.max_connections_per_peer
    try:
        # A stranger on web.sock: only the per-uid cap's worth are held, the rest refused.
        with holding(as_stranger(stranger), str(web), 300, 300 - per_peer, 30) as (flood, held):
            assert held["connected"] == 300, held
            # root on the same socket, and a token holder on TCP, are served meanwhile
            unix_status, _ = get(web, "/")
            tcp_status, _ = get(("127.0.0.1", port), "/", source="127.0.0.2")
            at_cap, _ = get(web, "/")  # (root's own share is untouched by the stranger's)
            after = last_report(flood)
    finally:
        rc = d.stop()
    assert (unix_status, tcp_status, at_cap) == (200, 200, 200)
    assert held["open"] == per_peer and held["refused"] == {"503": 300 - per_peer}, held
    # The held ones were closed at the head timeout, each with a 408.
    closed = after["closed"]
    assert after["open"] == 0 and closed == {"503": 300 - per_peer, "408": per_peer}, after
    assert rc == 0
    refused = d.events("web.refused")
    assert refused and all(e["reason"] == "max_connections_per_peer" for e in refused)
    assert all(e["listener"] == "unix" and e["peer"] == f"uid {stranger.uid}" for e in refused)
    assert len(refused) <= 3, "refusals are rate-limited in the log"
    timeouts = d.events("web.head_timeout")
    assert timeouts and all(e["timeout_s"] == 8 for e in timeouts)


def test_tcp_sources_are_capped_each_and_the_tcp_listener_apart_from_web_sock(
    root_dir: Path, stranger: Stranger
) -> None:
    keys = "max_connections = 40\nmax_connections_per_peer = 16\nhead_timeout_s = 30"
    d, port = dashboard_daemon(root_dir, stranger, keys)
    d.start()
    web = root_dir / "web.sock"
    tcp = f"127.0.0.1:{port}"
    me = [sys.executable]
    try:
        # One source holds its 16; another source is still served.
        with holding(me, tcp, 30, 14, 60, "127.0.0.3") as (one, held_one):
            assert held_one["open"] == 16 and held_one["refused"] == {"503": 14}, held_one
            assert get(("127.0.0.1", port), "/", source="127.0.0.2")[0] == 200
            # Two more sources fill the TCP listener's 40 ...
            with (
                holding(me, tcp, 16, 0, 60, "127.0.0.4") as (two, held_two),
                holding(me, tcp, 16, 8, 60, "127.0.0.5") as (three, held_three),
            ):
                assert held_two["open"] == 16 and held_three["open"] == 8, held_three
                # ... so TCP answers 503 to everyone now, and web.sock is served all the same.
                full, body = get(("127.0.0.1", port), "/", source="127.0.0.2")
                unix_status, _ = get(web, "/")
                for p in (one, two, three):
                    p.kill()
    finally:
        rc = d.stop()
    assert full == 503 and b"dashboard.max_connections = 40" in body, body
    assert unix_status == 200
    assert rc == 0
    reasons = {(e["listener"], e["reason"]) for e in d.events("web.refused")}
    assert reasons == {("tcp", "max_connections_per_peer"), ("tcp", "max_connections")}


def test_the_head_timeout_is_10_s_unless_configured() -> None:
    assert DashboardConfig().limits.head_timeout_s == 10
    assert load_config("").dashboard.limits.head_timeout_s == 10
    configured = load_config("[dashboard]\nhead_timeout_s = 2.5\nmax_streams_per_viewer = 3\n")
    assert configured.dashboard.limits.head_timeout_s == 2.5
    assert configured.dashboard.limits.max_streams_per_viewer == 3


def test_the_daemon_logs_its_dashboard_limits_with_a_10_s_head_timeout(
    root_dir: Path, stranger: Stranger
) -> None:
    d, _ = dashboard_daemon(root_dir, stranger)
    d.start()
    d.stop()
    (listening,) = d.events("dashboard.listening")
    assert listening["head_timeout_s"] == 10, listening
    assert listening["max_connections"] == 256 and listening["max_connections_per_peer"] == 64


# ----------------------------------------------------------------------------- streams


@contextmanager
def stream(
    address: Path | tuple[str, int], target: str, source: str | None = None
) -> Iterator[tuple[int, bytes]]:
    """A log stream's request, held open: its status and what came with its head."""
    if isinstance(address, Path):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if source is not None:
            s.bind((source, 0))
    with s:
        s.settimeout(20)
        s.connect(str(address) if isinstance(address, Path) else address)
        cookie = f"Cookie: llmd_dashboard={TOKEN}\r\n"
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: localhost\r\n{cookie}\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
        yield int(data.split(b" ", 2)[1]), data


def test_one_token_holder_cannot_take_every_live_log_stream(
    world: ReplayWorld, tmp_path: Path
) -> None:
    root = tmp_path / "daemon"
    root.mkdir()
    port = free_port()
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    daemon = Daemon(
        world,
        root,
        replay_socket=world.socket,
        extra_config=f'[dashboard]\ntcp = "127.0.0.1:{port}"\ntoken_file = "{token_file}"\n',
    )
    daemon.start()
    web = daemon.socket.parent / "web.sock"
    per_viewer = DashboardConfig().limits.max_streams_per_viewer
    try:
        run, _ = running_run(daemon, world, tmp_path / "logs")
        logs = f"/runs/{run}/logs"
        tcp = ("127.0.0.1", port)
        with ExitStack() as held:
            # One token holder (one source address) opens its share of streams ...
            statuses = [held.enter_context(stream(tcp, logs))[0] for _ in range(per_viewer)]
            over, body = get(tcp, logs)
            # ... and another token holder, and root on web.sock, still get theirs.
            other = held.enter_context(stream(tcp, logs, source="127.0.0.2"))[0]
            unix = held.enter_context(stream(web, logs))[0]
    finally:
        daemon.stop()
    assert statuses == [200] * per_viewer
    assert (over, other, unix) == (503, 200, 200), body
    assert f"dashboard.max_streams_per_viewer = {per_viewer}".encode() in body


# ----------------------------------------------------------------------------- queries

# Hostile values of a query parameter: unicode digits, huge numbers, empty, NUL, control
# characters, percent-encoded junk (invalid UTF-8, an overlong '/', a bare '%').
HOSTILE = [
    "%C2%B2",  # '²': isdigit() is True, int() fails
    "%D9%A3",  # Arabic-Indic three: int() takes it
    "%EF%BC%91",  # fullwidth one
    "-1",
    "1e3",
    "0x10",
    "%201",
    "",
    "9" * 400,
    "%00",
    "1%00",
    "%0A",
    "%1B%5B31m",
    "%FF%FE",
    "%C0%AF",
    "%ED%A0%80",  # a lone surrogate's UTF-8
    "%",
    "%ZZ",
    "x" * 5000,
]
# What each page reads, and the statuses every hostile value must get: 400 unless the
# value is an acceptable filter text (a run owner's name may be any printable text).
PARAMS = {
    "/": ["all", "state", "owner"],
    "/runs/mine": ["rank"],
    "/runs/mine/logs": ["rank", "from"],
    "/events": ["status"],
}
PRINTABLE = ["%C2%B2", "%D9%A3", "%EF%BC%91", "-1", "1e3", "0x10", "%201", "9" * 400, "%", "%ZZ"]
FILTERS = ("state", "owner", "status")  # their forms send "" for "any"


def expected(param: str, value: str) -> int:
    if value == "" and param in FILTERS:
        return 200
    if param == "owner" and value in PRINTABLE:
        return 200 if len(urllib.parse.unquote(value)) <= 300 else 400
    return 400


def test_hostile_query_values_of_every_page_answer_400_and_log_no_traceback(
    root_dir: Path, stranger: Stranger
) -> None:
    d, port = dashboard_daemon(root_dir, stranger)
    archive, logs = d.state_dir / "archive", root_dir / "logs"
    journal_runs(d, [finished_run("mine", "5", logs, archive)])
    d.start()
    web = root_dir / "web.sock"
    got: dict[tuple[str, str, str, str], int] = {}
    try:
        for path, params in PARAMS.items():
            for param in params:
                for value in [*HOSTILE, "1&" + param + "=1"]:  # the last one: repeated
                    target = f"{path}?{param}={value}"
                    got[("unix", path, param, value)] = get(web, target)[0]
                # On TCP too, as a token holder and (before any access check) without one.
                got[("tcp", path, param, "%C2%B2")] = get(
                    ("127.0.0.1", port), f"{path}?{param}=%C2%B2", source="127.0.0.2"
                )[0]
        # The good values still work.
        good = [
            "/?all=1&state=running&owner=root",
            "/?state=&owner=",
            "/runs/mine?rank=1",
            "/runs/mine/logs?rank=0",
            "/events?status=dead",
        ]
        fine = {t: get(web, t)[0] for t in good}
        untokened = get(("127.0.0.1", port), "/runs/mine/logs?rank=%C2%B2", token=False)[0]
        # The token parameter itself (read before any page): a wrong one is refused.
        tokens = {
            v: get(("127.0.0.1", port), f"/?token={v}", token=False)[0]
            for v in [*HOSTILE, "1&token=1"]
        }
    finally:
        d.stop()
    wrong = {
        k: v
        for k, v in got.items()
        if v != (400 if k[3].startswith("1&") else expected(k[2], k[3]))
    }
    assert not wrong, (len(wrong), {k: v for k, v in wrong.items() if v >= 500} or wrong)
    assert fine == dict.fromkeys(good, 200), fine
    assert untokened == 403  # no token: refused before anything is read
    assert tokens == dict.fromkeys(tokens, 403), tokens
    assert not d.events("dashboard.request_failed")
    assert "Traceback" not in d.log_text()
