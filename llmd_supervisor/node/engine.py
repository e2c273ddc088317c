"""Stand-in for a vLLM prefill/decode engine: stdlib only, Python 3.9+.

Serves ``GET /health`` and a minimal OpenAI-style ``POST /v1/completions``:
  * a prefill engine answers with one token and ``kv_transfer_params`` naming itself
    (``remote_engine_id``, ``remote_host``, ``remote_port``), as vLLM's NIXL connector does
    when asked with ``kv_transfer_params.do_remote_decode``;
  * a decode engine answers with ``max_tokens`` tokens, and when handed
    ``kv_transfer_params`` it fetches ``GET /kv/<request_id>`` from that prefill engine
    (the cross-node KV transfer stand-in) and fails the request if that fails.

Fault knobs (environment; applied only on the ranks listed in ``LLMD_FAKE_FAULT_RANKS``
when that is set, compared with ``LLMD_RANK``):
  * ``LLMD_FAKE_ENGINE_STARTUP_S``: sleep before listening;
  * ``LLMD_FAKE_ENGINE_NEVER_HEALTHY=1``: ``/health`` answers 503 forever;
  * ``LLMD_FAKE_ENGINE_CRASH_AFTER_S=N``: exit with rc 3 N seconds after start;
  * ``LLMD_FAKE_ENGINE_HANG=1``: accept connections but never answer anything;
  * ``LLMD_FAKE_ENGINE_IGNORE_SIGTERM=1``: ignore SIGTERM (only SIGKILL stops it);
  * ``LLMD_FAKE_PLANT=KIND:NAME[=ARG],...``: at start, act as a hostile job in its own log
    directory (``LLMD_LOG_DIR``; ``%j`` and ``%x`` in NAME are the job id and name): put a
    ``link`` to ARG, a ``fifo``, a ``device`` (like /dev/zero), a ``dir`` or a ``big`` file
    of ARG bytes at NAME, replacing what is there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

CRASH_RC = 3


def fault_active() -> bool:
    ranks = os.environ.get("LLMD_FAKE_FAULT_RANKS", "").strip()
    if not ranks:
        return True
    return os.environ.get("LLMD_RANK", "") in [r.strip() for r in ranks.split(",")]


def fault(name: str) -> str:
    return os.environ.get(name, "") if fault_active() else ""


def plant(spec: str) -> None:
    """Carry out LLMD_FAKE_PLANT (see the module docstring)."""
    log_dir = os.environ["LLMD_LOG_DIR"]
    for item in filter(None, (i.strip() for i in spec.split(","))):
        kind, _, rest = item.partition(":")
        name, _, arg = rest.partition("=")
        name = name.replace("%j", os.environ.get("LLMD_JOB_ID", "")).replace(
            "%x", os.environ.get("SLURM_JOB_NAME", "")
        )
        path = os.path.join(log_dir, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            os.unlink(path)
        if kind == "link":
            os.symlink(arg, path)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "device":
            os.mknod(path, 0o600 | 0o020000, os.makedev(1, 5))  # a character device
        elif kind == "dir":
            os.makedirs(path, exist_ok=True)
        elif kind == "big":
            with open(path, "wb") as f:
                for _ in range(int(arg) >> 16):
                    f.write(b"b" * 65535 + b"\n")
        else:
            raise SystemExit("LLMD_FAKE_PLANT: unknown kind %r" % kind)
        print("fault: planted %s at %s" % (kind, path), flush=True)


class Engine(object):
    def __init__(self, role: str, served_name: str, host: str, port: int) -> None:
        self.role = role
        self.served_name = served_name
        self.host = host
        self.port = port
        self.engine_id = "%s-%s-%d" % (role, host, port)
        self.never_healthy = fault("LLMD_FAKE_ENGINE_NEVER_HEALTHY") == "1"
        self.hang = fault("LLMD_FAKE_ENGINE_HANG") == "1"
        self.kv: Dict[str, List[int]] = {}
        self.lock = threading.Lock()
        self.requests = 0


def make_handler(engine: Engine) -> Any:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            sys.stdout.write("%s %s\n" % (self.address_string(), format % args))
            sys.stdout.flush()

        def _send(self, status: int, body: Dict[str, Any]) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _hang(self) -> None:
            while True:
                time.sleep(3600)

        def do_GET(self) -> None:
            if engine.hang:
                self._hang()
            if self.path == "/health":
                if engine.never_healthy:
                    self._send(503, {"status": "starting"})
                else:
                    self._send(200, {"status": "ok", "role": engine.role})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": engine.served_name}]})
            elif self.path.startswith("/kv/") and engine.role == "prefill":
                with engine.lock:
                    blocks = engine.kv.pop(self.path[4:], None)
                if blocks is None:
                    self._send(404, {"error": "unknown request id"})
                else:
                    self._send(200, {"blocks": blocks})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            if engine.hang:
                self._hang()
            if self.path != "/v1/completions":
                self._send(404, {"error": "not found"})
                return
            length = int(self.headers.get("Content-Length", "0"))
            try:
                req = json.loads(self.rfile.read(length).decode("utf-8"))
            except ValueError:
                self._send(400, {"error": "bad json"})
                return
            if req.get("model") != engine.served_name:
                self._send(404, {"error": "model %r not served here" % req.get("model")})
                return
            prompt = str(req.get("prompt", ""))
            max_tokens = int(req.get("max_tokens", 16))
            with engine.lock:
                engine.requests += 1
                rid = "%s-%d" % (engine.engine_id, engine.requests)
            kv_in = req.get("kv_transfer_params") or {}
            body: Dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "model": engine.served_name,
                "choices": [],
                "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": 0},
            }
            if engine.role == "prefill":
                with engine.lock:
                    engine.kv[rid] = [len(prompt)]
                body["choices"] = [{"index": 0, "text": "t", "finish_reason": "length"}]
                body["usage"]["completion_tokens"] = 1
                body["kv_transfer_params"] = {
                    "remote_engine_id": engine.engine_id,
                    "remote_request_id": rid,
                    "remote_host": engine.host,
                    "remote_port": engine.port,
                }
            else:
                if kv_in.get("remote_host"):
                    url = "http://%s:%s/kv/%s" % (
                        kv_in["remote_host"],
                        kv_in["remote_port"],
                        kv_in["remote_request_id"],
                    )
                    try:
                        with urllib.request.urlopen(url, timeout=10) as resp:
                            json.loads(resp.read().decode("utf-8"))
                    except Exception as exc:
                        self._send(502, {"error": "kv transfer from %s failed: %s" % (url, exc)})
                        return
                time.sleep(0.001 * max_tokens)
                body["choices"] = [
                    {"index": 0, "text": " tok" * max_tokens, "finish_reason": "length"}
                ]
                body["usage"]["completion_tokens"] = max_tokens
            self._send(200, body)

    return Handler


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="stand-in llm-d engine")
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-name", required=True)
    args = parser.parse_args(argv)

    if fault("LLMD_FAKE_ENGINE_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("fault: ignoring SIGTERM", flush=True)
    else:
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))
    if fault("LLMD_FAKE_PLANT"):
        plant(fault("LLMD_FAKE_PLANT"))
    startup = float(fault("LLMD_FAKE_ENGINE_STARTUP_S") or 0)
    if startup > 0:
        time.sleep(startup)
    crash_after = fault("LLMD_FAKE_ENGINE_CRASH_AFTER_S")
    if crash_after:

        def crash() -> None:
            time.sleep(float(crash_after))
            print("fault: crashing with rc %d" % CRASH_RC, flush=True)
            os._exit(CRASH_RC)

        threading.Thread(target=crash, daemon=True).start()

    engine = Engine(args.role, args.served_name, args.host, args.port)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine))
    server.daemon_threads = True
    print(
        "stand-in %s engine serving %s on %s:%d (pid %d)"
        % (args.role, args.served_name, args.host, args.port, os.getpid()),
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
