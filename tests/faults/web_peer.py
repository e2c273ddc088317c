"""A hostile dashboard peer, stdlib only: run by tests/faults/test_dashboard_limits.py, as
another uid (``setpriv ... /usr/bin/python3 web_peer.py``) or as the test's own.

  hold ADDRESS N REFUSED HOLD_S [SOURCE]

ADDRESS is a Unix socket's path or HOST:PORT; SOURCE the address TCP connections come from.
Opens N connections and sends each an unfinished request head (no blank line), then reads
until REFUSED of them were answered and closed by the server (at most 15 s) and prints one
JSON line: how many connected, are still open, and the statuses of the refused. Then reads
until every connection is closed by the server (at most HOLD_S seconds) and prints one more
line: how many are still open and the statuses of all closed ones (0: closed without a
status line), and exits.
"""

from __future__ import annotations

import json
import resource
import selectors
import socket
import sys
import time

_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

HEAD = b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Unfinished: "


def connect(address: str, source: str | None) -> socket.socket | None:
    """A connection that sent its unfinished head; None when none could be made."""
    deadline = time.monotonic() + 10
    while True:
        if address.startswith("/"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: object = address
        else:
            host, _, port = address.rpartition(":")
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            if source is not None:
                s.bind((source, 0))
            target = (host, int(port))
        try:
            s.connect(target)  # type: ignore[arg-type]
            s.sendall(HEAD)
        except (BlockingIOError, ConnectionRefusedError, InterruptedError):
            s.close()  # a full listen queue: try again shortly
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
            continue
        except OSError:
            s.close()
            return None
        s.setblocking(False)
        return s


class Held:
    def __init__(self, conns: list[socket.socket]) -> None:
        self.sel = selectors.DefaultSelector()
        self.data: dict[socket.socket, bytes] = {}
        for s in conns:
            self.sel.register(s, selectors.EVENT_READ)
            self.data[s] = b""
        self.statuses: list[int] = []

    @property
    def open(self) -> int:
        return len(self.data)

    def pump(self, until_closed: int, seconds: float) -> None:
        """Read until `until_closed` connections were closed in all (or `seconds` passed)."""
        deadline = time.monotonic() + seconds
        while len(self.statuses) < until_closed and self.data:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for key, _ in self.sel.select(min(left, 1.0)):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    self.data[s] += chunk
                    continue
                got = self.data.pop(s)
                self.sel.unregister(s)
                s.close()
                parts = got.split(b" ", 2)
                ok = len(parts) > 1 and got.startswith(b"HTTP/") and parts[1].isdigit()
                self.statuses.append(int(parts[1]) if ok else 0)


def counts(statuses: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in statuses:
        out[str(s)] = out.get(str(s), 0) + 1
    return out


def say(report: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


def hold(address: str, n: int, refused: int, hold_s: float, source: str | None) -> None:
    conns = [c for c in (connect(address, source) for _ in range(n)) if c is not None]
    held = Held(conns)
    held.pump(refused, 15)
    report = {"connected": len(conns), "open": held.open, "refused": counts(held.statuses)}
    say(report)
    held.pump(len(conns), hold_s)
    say({"open": held.open, "closed": counts(held.statuses)})


def main(argv: list[str]) -> None:
    if argv[:1] == ["hold"] and len(argv) in (5, 6):
        source = argv[5] if len(argv) == 6 else None
        hold(argv[1], int(argv[2]), int(argv[3]), float(argv[4]), source)
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
