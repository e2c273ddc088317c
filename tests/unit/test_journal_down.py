"""A daemon whose PostgreSQL journal cannot be reached at start (issue 4.1, item 9): the
real daemon process, with ``[journal] url`` at a port where nothing listens, at a real
server with a wrong password, and with a password in the URL. Each time it exits non-zero
after ONE line naming the URL (never a password) and the reason: no traceback, no
secret."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.devcluster import REPO
from tests.postgres import PgServer

WRONG = "not-the-password-7f3a"


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound (so nobody else takes it) and not
    listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def start_daemon(tmp_path: Path, journal: str) -> subprocess.CompletedProcess[str]:
    """The daemon with this ``[journal]`` table; it must end by itself (bounded)."""
    (tmp_path / "known_hosts").touch()
    config = tmp_path / "config.toml"
    config.write_text(
        f"""
[daemon]
state_dir = "{tmp_path / "state"}"
socket = "{tmp_path / "control.sock"}"
log_roots = ["/tmp"]
log_format = "json"

[ssh]
known_hosts = "{tmp_path / "known_hosts"}"
port = 9

[[clusters]]
name = "dev"

[journal]
{journal}
"""
    )
    return subprocess.run(
        [sys.executable, "-m", "llmd_supervisor", "daemon", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )


def one_line(done: subprocess.CompletedProcess[str], *named: str) -> str:
    """The daemon's one line on stderr; asserts it ended non-zero with nothing else."""
    everything = done.stdout + done.stderr
    assert done.returncode != 0, everything
    assert "Traceback" not in everything, everything
    assert done.stdout.strip() == "", everything  # the log has nothing but what stderr says
    lines = done.stderr.splitlines()
    assert len(lines) == 1, everything
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


def test_nothing_listening_is_one_line_naming_the_url_and_the_reason(
    tmp_path: Path, closed_port: int
) -> None:
    url = f"postgresql://llmd@127.0.0.1:{closed_port}/llmd"
    line = one_line(start_daemon(tmp_path, f'url = "{url}"'), url, "Connection refused")
    assert line.startswith("llmd-supervisor daemon: Journal ")


def test_a_wrong_password_is_one_line_without_the_password(
    tmp_path: Path, postgres: PgServer
) -> None:
    wrong = tmp_path / "db-password"
    wrong.write_text(f"{WRONG}\n")
    wrong.chmod(0o600)
    url = postgres.url(postgres.new_database())
    done = start_daemon(tmp_path, f'url = "{url}"\npassword_file = "{wrong}"')
    one_line(done, url, "password authentication failed")
    assert WRONG not in done.stderr and postgres.password() not in done.stderr


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://llmd:{WRONG}@127.0.0.1/llmd",
        f"postgresql://llmd@127.0.0.1/llmd?pass%77ord={WRONG}",
        f"postgresql://llmd@127.0.0.1/llmd?SSLPASSWORD={WRONG}",
    ],
)
def test_a_password_in_the_url_is_refused_in_one_masked_line(tmp_path: Path, url: str) -> None:
    done = start_daemon(tmp_path, f'url = "{url}"')
    one_line(done, "journal.url", "holds a secret", "postgresql://llmd")
    assert WRONG not in done.stderr and done.returncode == 2
