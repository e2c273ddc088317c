"""A hostile control-socket peer, stdlib only: run as another uid by
tests/faults/test_socket_limits.py (``setpriv ... /usr/bin/python3 socket_peer.py``).

  flood PATH N HOLD_S             open N idle connections, hold them HOLD_S seconds
  halfsend PATH N SIZE HOLD_S     open N connections, send SIZE bytes of a line to each
                                  (no newline), hold them HOLD_S seconds
  unread PATH N LINE HOLD_S       open N connections, send LINE on each and read nothing
                                  for HOLD_S seconds (then read what is there)
  request PATH LINE...            send each JSON line on one connection, print each reply

flood and halfsend print one JSON line once the connections are set up (how many are
open, how many were told ``busy``), then one more at the end (how many were told
``timeout`` or closed meanwhile), and exit.
"""

from __future__ import annotations

import json
import resource
import select
import socket
import sys
import time

_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def connect(path: str) -> socket.socket | None:
    """A connection, retried while the listen queue is full (EAGAIN on a Unix socket)."""
    deadline = time.monotonic() + 10
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
            continue
        except OSError:
            s.close()
            return None
        return s


class Peer:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""
        self.closed = False

    def pump(self) -> None:
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    self.closed = True
                    return
                self.data += chunk
        except BlockingIOError:
            return
        except OSError:
            self.closed = True

    def codes(self) -> list[str]:
        """The error codes of the whole reply lines received."""
        out = []
        for line in self.data.split(b"\n")[:-1]:
            try:
                reply = json.loads(line)
            except ValueError:
                out.append("?")
                continue
            if "stream" not in reply:
                out.append(reply.get("error", {}).get("code", "ok"))
        return out


def settle(peers: list[Peer], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        live = [p for p in peers if not p.closed]
        if not live:
            return
        for i in range(0, len(live), 500):  # select() takes fds below 1024 only: poll
            poll = select.poll()
            by_fd = {p.sock.fileno(): p for p in live[i : i + 500]}
            for fd in by_fd:
                poll.register(fd, select.POLLIN)
            for fd, _ in poll.poll(50):
                by_fd[fd].pump()


def report(peers: list[Peer], **extra: object) -> None:
    codes = [c for p in peers for c in p.codes()]
    streamed = sum(1 for p in peers if b'"stream"' in p.data)
    summary = {
        "streamed": streamed,
        "open": sum(1 for p in peers if not p.closed),
        "closed": sum(1 for p in peers if p.closed),
        "busy": codes.count("busy"),
        "timeout": codes.count("timeout"),
        "other": len(codes) - codes.count("busy") - codes.count("timeout"),
        **extra,
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()


def send_all(peers: list[Peer], payload: bytes, seconds: float) -> int:
    """Send `payload` to every peer as far as the daemon takes it; bytes sent in all."""
    left = {id(p): payload for p in peers}
    total = 0
    deadline = time.monotonic() + seconds
    while left and time.monotonic() < deadline:
        progressed = False
        for p in peers:
            rest = left.get(id(p))
            if rest is None:
                continue
            try:
                n = p.sock.send(rest[:65536])
            except BlockingIOError:
                continue
            except OSError:
                del left[id(p)]
                continue
            total += n
            progressed = True
            if n == len(rest):
                del left[id(p)]
            else:
                left[id(p)] = rest[n:]
        if not progressed:
            time.sleep(0.02)
    return total


def main(argv: list[str]) -> int:
    mode, path = argv[0], argv[1]
    if mode == "request":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(path)
        f = s.makefile("rb")
        for line in argv[2:]:
            s.sendall(line.encode() + b"\n")
            while True:
                reply = f.readline()
                sys.stdout.write(reply.decode())
                if b'"stream"' not in reply:
                    break
        sys.stdout.flush()
        return 0
    n = int(argv[2])
    peers = [Peer(s) for s in (connect(path) for _ in range(n)) if s is not None]
    sent = 0
    if mode == "halfsend":
        size = int(argv[3])
        head = b'{"v":1,"id":1,"op":"ping","args":{"x":"'
        sent = send_all(peers, head + b"a" * (size - len(head)), 20)
    hold = float(argv[-1])
    if mode == "unread":
        sent = send_all(peers, argv[3].encode() + b"\n", 10)
        time.sleep(hold)
        settle(peers, 1.0)
        report(peers, connected=len(peers), sent=sent)
        return 0
    settle(peers, 1.0)
    report(peers, connected=len(peers), sent=sent)
    settle(peers, hold)
    report(peers, connected=len(peers), sent=sent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
