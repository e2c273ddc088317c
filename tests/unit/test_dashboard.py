"""The dashboard of a whole daemon (issue 3.6), on a replayed cluster
(tests/fakes/replay_world.py) whose job stays running while the test writes its log:

- in a real browser (Playwright driving Debian's chromium) over loopback TCP with the
  token: the runs table lists the run with its stage, the run page appends a log line
  written after it loaded (server-sent events), a hostile log line shows as text, a
  finished run's chart has one point per concurrency, no request leaves the page's
  origin, no CSP violation is reported, and screenshots are kept (in
  $LLMD_TEST_ARTIFACTS when set);
- over the Unix socket with a plain HTTP client: the peer's uid decides what it sees (a
  stranger in the socket's group sees no run of root's; one outside it cannot connect), a
  wrong token or a foreign Host is refused on TCP, writes are 405, and a log stream
  resumed from its Last-Event-ID sends exactly the bytes after it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd_supervisor.core.config import DashboardConfig
from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.core.web.pages import CSP
from llmd_supervisor.errors import SupervisorError
from llmd_supervisor.supervision.web.dashboard import TAIL_BYTES, load_token, tail_offsets
from tests.browser import browser_page, free_port, http, screenshots
from tests.daemon_helpers import Daemon, demo_spec, run_to_end
from tests.fakes.replay_world import ReplayWorld
from tests.strangers import Stranger

pytestmark = pytest.mark.timeout(180)

HOSTILE = "<img src=x onerror=alert(1)>"
BENCHMARK = load_spec(demo_spec(Path("/tmp"))).benchmark  # the demo's, whatever its log dir


@contextlib.contextmanager
def sse(path: Path, url: str, last_event_id: str | None = None) -> Iterator[socket.socket]:
    """An open server-sent event stream over the Unix socket (its response head read)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        extra = f"Last-Event-ID: {last_event_id}\r\n" if last_event_id else ""
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n".encode())
        yield s


def events_until(
    s: socket.socket, done: str, timeout: float = 30
) -> list[tuple[str, str | None, dict[str, object]]]:
    """(event, id, data) of every event until one whose data's text holds `done`."""
    buf = b""
    out: list[tuple[str, str | None, dict[str, object]]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        buf += s.recv(65536)
        # the body is chunked: drop the chunk-size lines, keep the events' text
        text = b"\n".join(line for line in buf.split(b"\r\n") if not _is_hex(line)).decode()
        out = []
        for block in text.split("\n\n"):
            fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line[:7])
            if "event" in fields and "data" in fields:
                try:
                    data = json.loads(fields["data"])
                except ValueError:
                    continue  # not all of it has arrived yet
                out.append((fields["event"], fields.get("id"), data))
        if any(done in str(d.get("text", "")) for _, _, d in out):
            return out
    raise TimeoutError(f"no event with {done!r} within {timeout} s: {out[-3:]}")


def _is_hex(line: bytes) -> bool:
    return bool(line) and all(c in b"0123456789abcdefABCDEF" for c in line)


def wait_for(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def running_run(daemon: Daemon, world: ReplayWorld, logs: Path) -> tuple[str, Path]:
    """Submit the demo run and wait until it runs; its id and its batch log (node side)."""
    world.running_s = 600.0  # the job stays RUNNING while the test writes its log
    proc = daemon.submit(demo_spec(logs))
    assert proc.returncode == 0, proc.stderr
    run = str(json.loads(proc.stdout)["run"])
    status = daemon.wait_state(run, {"running"}, timeout=60)
    job_id = str(status["slurm_job_id"])
    out = world.call(lambda: world.cluster.jobs[job_id]._output_paths()[0])
    deadline = time.monotonic() + 30
    while "line 19" not in Path(out).read_text():
        assert time.monotonic() < deadline, "the job wrote no batch log"
        time.sleep(0.1)
    return run, Path(out)


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_the_dashboard_in_a_browser_over_tcp_with_its_token(
    world: ReplayWorld, tmp_path: Path
) -> None:
    root = tmp_path / "daemon"
    root.mkdir()
    port = free_port()
    daemon = Daemon(
        world,
        root,
        replay_socket=world.socket,
        extra_config=f'[dashboard]\ntcp = "127.0.0.1:{port}"\n',
    )
    daemon.start()
    try:
        run, out = running_run(daemon, world, tmp_path / "logs" / "live")
        token_file = daemon.state_dir / "dashboard.token"
        wait_for(token_file)
        token = token_file.read_text().strip()
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        origin = f"http://127.0.0.1:{port}"
        # Refused: no token, a wrong one, a foreign Host (DNS rebinding), a write.
        assert http(("127.0.0.1", port), "/")[0] == 403
        assert http(("127.0.0.1", port), "/?token=wrong")[0] == 403
        foreign = {"Host": f"evil.example:{port}"}
        assert http(("127.0.0.1", port), f"/?token={token}", headers=foreign)[0] == 403
        assert http(("127.0.0.1", port), "/", method="POST")[0] == 405

        shots = screenshots(tmp_path)
        with browser_page() as (page, seen):
            response = page.goto(f"{origin}/?token={token}")
            assert response is not None and response.status == 200
            assert response.headers["content-security-policy"] == CSP
            assert page.url == f"{origin}/"  # the token went into a cookie
            row = page.locator("table.runs tbody tr", has_text=run)
            assert row.count() == 1
            assert "running" in row.inner_text()

            response = page.goto(f"{origin}/runs/{run}")
            assert response is not None and response.status == 200
            assert response.headers["content-security-policy"] == CSP
            log = page.locator("#log")
            log.filter(has_text="line 19").wait_for(timeout=30_000)
            marker = f"live line {time.monotonic_ns()}"
            append(out, f"{marker}\n{HOSTILE}\n")
            log.filter(has_text=marker).wait_for(timeout=30_000)
            log.filter(has_text=HOSTILE).wait_for(timeout=30_000)
            assert page.locator("#log img").count() == 0
            assert page.locator("img[src=x]").count() == 0
            page.screenshot(path=str(shots / "dashboard-run.png"), full_page=True)

            # A finished run: its chart has one point per concurrency.
            world.running_s = 1.0
            done = run_to_end(daemon, demo_spec(tmp_path / "logs" / "done"))
            assert done["outcome"] == "succeeded", done["reason"]
            response = page.goto(f"{origin}/runs/{done['run']}")
            assert response is not None and response.status == 200
            chart = page.locator('img.chart[src*="/total-tput-vs-interactivity.svg"]')
            assert chart.count() == 1
            src = chart.get_attribute("src")
            assert src is not None and src.startswith("/runs/")
            svg = page.request.get(origin + src)
            assert svg.status == 200 and svg.headers["content-type"] == "image/svg+xml"
            points = svg.text().count('class="point"')
            assert points == len(BENCHMARK.concurrencies), points
            page.wait_for_function(
                "document.querySelector('img.chart').naturalWidth > 0", timeout=60_000
            )
            page.screenshot(path=str(shots / "dashboard-results.png"), full_page=True)
        assert seen.requests, "the browser made no request"
        assert all(url.startswith(origin + "/") for url in seen.requests), seen.requests
        assert not seen.dialogs, seen.dialogs
        assert not [c for c in seen.console if "Content Security Policy" in c], seen.console
    finally:
        daemon.stop()


def test_the_unix_socket_shows_each_peer_its_own_runs_and_resumes_logs(
    world: ReplayWorld, tmp_path: Path, stranger: Stranger, root_dir: Path
) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is not installed; the stranger's requests are made with it.")
    daemon = Daemon(
        world,
        root_dir,
        replay_socket=world.socket,
        daemon_keys=f'socket_group = "{stranger.name}"',
    )
    daemon.start()
    web = root_dir / "web.sock"
    try:
        run, out = running_run(daemon, world, tmp_path / "logs" / "unix")
        wait_for(web)
        assert oct(web.stat().st_mode & 0o777) == "0o660"
        status, headers, body = http(web, "/")
        assert status == 200 and headers["content-security-policy"] == CSP
        assert f'href="/runs/{run}"'.encode() in body
        assert http(web, f"/runs/{run}")[0] == 200
        assert http(web, f"/runs/{run}", method="POST")[0] == 405
        assert http(web, f"/runs/{run}", method="DELETE")[0] == 405
        # Through `ssh -L` the socket is a workstation's loopback port: DNS rebinding
        assert http(web, "/", headers={"Host": "evil.example:8080"})[0] == 403

        # A stranger in the socket's group sees none of root's runs; one outside it cannot
        # even connect.
        def as_stranger(path: str, gid: int) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["setpriv", f"--reuid={stranger.uid}", f"--regid={gid}", "--clear-groups",
                 curl, "-s", "-o", "/dev/null", "-w", "%{http_code}", "--unix-socket",
                 str(web), f"http://localhost{path}"],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip

        assert as_stranger(f"/runs/{run}", stranger.gid).stdout == "404"
        listing = subprocess.run(
            ["setpriv", f"--reuid={stranger.uid}", f"--regid={stranger.gid}",
             "--clear-groups", curl, "-s", "--unix-socket", str(web), "http://localhost/"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert "0 of 0 runs" in listing.stdout and run not in listing.stdout
        refused = as_stranger("/", 65534)
        assert refused.returncode != 0 and refused.stdout in ("", "000")

        # A log stream resumed from its last event id sends exactly what came after.
        with sse(web, f"/runs/{run}/logs") as s:
            seen = events_until(s, "line 19")
        logs = [(i, d) for e, i, d in seen if e == "log"]
        last_id = logs[-1][0]
        assert last_id is not None
        batch = next(str(d["file"]) for _, d in logs if str(d["file"]).endswith(".out"))
        marker = f"resumed line {time.monotonic_ns()}\n"
        append(out, marker)
        with sse(web, f"/runs/{run}/logs", last_event_id=last_id) as s:
            again = events_until(s, "resumed line")
        resumed = [d for e, _, d in again if e == "log" and d["file"] == batch]
        assert "".join(str(d["text"]) for d in resumed) == marker
    finally:
        daemon.stop()
    assert not web.exists()  # removed on the way out


def test_a_token_is_made_private_at_each_start_and_a_readable_token_file_is_refused(
    tmp_path: Path,
) -> None:
    first, path = load_token(DashboardConfig(), tmp_path)
    assert path == tmp_path / "dashboard.token" and path.read_text().strip() == first
    assert path.stat().st_mode & 0o777 == 0o600 and len(first) >= 32
    assert load_token(DashboardConfig(), tmp_path)[0] != first
    mine = tmp_path / "mine.token"
    mine.write_text("0123456789abcdef0123\n")
    mine.chmod(0o640)
    with pytest.raises(SupervisorError, match="others may read it"):
        load_token(DashboardConfig(token_file=str(mine)), tmp_path)
    mine.chmod(0o600)
    assert load_token(DashboardConfig(token_file=str(mine)), tmp_path) == (
        "0123456789abcdef0123",
        mine,
    )
    mine.write_text("short")
    with pytest.raises(SupervisorError, match="at least 16"):
        load_token(DashboardConfig(token_file=str(mine)), tmp_path)


def test_a_fresh_log_stream_starts_at_each_copys_tail(tmp_path: Path) -> None:
    (tmp_path / "attempt1" / "7").mkdir(parents=True)
    (tmp_path / "attempt1" / "big.out").write_bytes(b"x" * (TAIL_BYTES + 10))
    (tmp_path / "attempt1" / "7" / "small.log").write_bytes(b"y" * 10)
    assert tail_offsets(tmp_path) == {"attempt1/big.out": 10}
    assert tail_offsets(tmp_path / "missing") == {}
