"""A real browser and a plain HTTP client for the dashboard's tests: Playwright driving
Debian's chromium (its own browser download is not reachable here), and one HTTP/1.1
request at a time over a Unix socket or loopback TCP."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"


def playwright_chromium() -> Any:
    """Playwright's sync API, or a failure naming what to install (never a skip)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "playwright is not installed, and the dashboard's browser test drives chromium "
            "with it: pip install -e '.[dev]' (deploy/install-dev.sh does)."
        )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"{CHROMIUM} is not installed, and the dashboard's browser test drives it: run "
            "deploy/install-dev.sh (or apt-get install -y chromium)."
        )
    return sync_playwright


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(
    address: Path | tuple[str, int],
    path: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    timeout: float = 20,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a Unix socket (a path) or TCP; status, headers, body."""
    family = socket.AF_UNIX if isinstance(address, Path) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(address) if isinstance(address, Path) else address)
        head = {"Host": "localhost", "Connection": "close", **(headers or {})}
        lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items())]
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    found = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        found[k.strip().lower()] = v.strip()
    if found.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return int(status_line.split()[1]), found, body


def _unchunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_text, _, rest = body.partition(b"\r\n")
        size = int(size_text.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return out


@dataclass
class Seen:
    """What a page did: the URLs it requested, its console messages, its dialogs."""

    requests: list[str] = field(default_factory=list)
    console: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)


@contextlib.contextmanager
def browser_page() -> Iterator[tuple[Any, Seen]]:
    """A page of a headless chromium driven by Playwright, and what it does (a dialog is
    recorded and dismissed); the browser is closed at the end."""
    sync_playwright = playwright_chromium()
    seen = Seen()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("request", lambda r: seen.requests.append(r.url))
            page.on("console", lambda m: seen.console.append(f"{m.type}: {m.text}"))

            def dialog(d: Any) -> None:
                seen.dialogs.append(d.message)
                d.dismiss()

            page.on("dialog", dialog)
            yield page, seen
        finally:
            browser.close()


def screenshots(tmp_path: Path) -> Path:
    """Where a test keeps its screenshots: $LLMD_TEST_ARTIFACTS when set."""
    shots = Path(os.environ.get("LLMD_TEST_ARTIFACTS", str(tmp_path)))
    shots.mkdir(parents=True, exist_ok=True)
    return shots
