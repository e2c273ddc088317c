"""Stand-in for a vLLM prefill/decode engine: stdlib only, Python 3.9+.

Serves ``GET /health``, ``GET /v1/models`` and minimal OpenAI-style
``POST /v1/completions`` and ``POST /v1/chat/completions``. With ``"stream": true`` the
answer is server-sent events, one chunk per token, a usage chunk when
``stream_options.include_usage`` is set, then ``data: [DONE]``.

Two ways to start it:

* the original stand-in flag ``--role prefill|decode`` (the current demo): a prefill
  engine answers every request with one token and ``kv_transfer_params`` naming itself; a
  decode engine handed ``kv_transfer_params`` with a ``remote_host`` fetches the KV from
  there and fails the request (502) if that fails; without them it does both phases;
* vLLM's own flag ``--kv-transfer-config JSON`` (also ``--kv_transfer_config``, as
  InferenceX writes it) with ``kv_connector`` ``NixlConnector`` and ``kv_role``
  ``kv_producer`` / ``kv_consumer`` / ``kv_both`` (``--role`` then follows from
  ``kv_role`` unless given), optionally ``engine_id`` and ``kv_load_failure_policy``
  (``fail``, vLLM's current default, or ``recompute``). It then behaves like vLLM's
  NixlConnector (tests/data/upstream/vllm-nixl-connector.md):

  - a request whose ``kv_transfer_params`` has ``do_remote_decode`` (the P/D sidecar's
    prefill leg, sent with ``max_tokens=1``) is answered with ``kv_transfer_params``
    ``{do_remote_prefill: true, do_remote_decode: false, remote_block_ids,
    remote_engine_id, remote_request_id, remote_host, remote_port, tp_size}``; the KV
    stays here, keyed by ``remote_request_id``, until a decode engine fetches it or
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` s (default 480) pass. A ``kv_consumer`` refuses
    such a request (400; stricter than vLLM, to make a miswired topology visible);
  - a request with ``do_remote_prefill`` is a decode leg: a ``kv_producer`` refuses it
    (400); otherwise ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
    ``remote_host`` and ``remote_port`` must all be set -- params no prefill returned
    are refused (400; vLLM would skip the transfer with a warning, or trip an assertion
    when ``remote_block_ids`` is empty) -- and the KV is fetched from
    ``remote_host:remote_port``. When that prefill engine does not know the request (or
    has another engine id, or other blocks), the request fails (500) under policy
    ``fail``, or is computed locally under ``recompute``;
  - a request without ``kv_transfer_params`` is served locally (prefill and decode), as
    vLLM does (the sidecar's path when the router picked no prefill endpoint).

``remote_host`` is ``$VLLM_NIXL_SIDE_CHANNEL_HOST`` when set, else ``--host`` (``0.0.0.0``
becomes ``localhost``, vLLM's default). ``remote_port`` is ``$VLLM_NIXL_SIDE_CHANNEL_PORT``
when set -- the KV fetch (``GET /kv/<request id>``, the NIXL stand-in) is then served on
that extra port too -- else the HTTP port. The request id is ``cmpl-<x-request-id>-<n>``
when that header is sent (the sidecar sends one), else ``<engine id>-<n>``. Each request
logs one line: ``engine: request_id=... leg=prefill|decode|local ... status=...``.

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
import math
import os
import signal
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

if __package__:  # imported from the installed package (the tests)
    from .faults import fault, say
else:  # run from the job's node directory, where faults.py lies beside this file
    from faults import fault, say  # type: ignore[import-not-found,no-redef]

CRASH_RC = 3
BLOCK_SIZE = 16  # tokens per KV block (vLLM's default block size on CUDA)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
REMOTE_FIELDS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


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
        say("fault: planted %s at %s" % (kind, path))


class Engine(object):
    def __init__(
        self,
        role: str,
        served_name: str,
        host: str,
        port: int,
        kv_config: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.role = role
        self.served_name = served_name
        self.host = host
        self.port = port
        self.kv_config = kv_config
        self.kv_role = str(kv_config["kv_role"]) if kv_config else ""
        self.policy = str((kv_config or {}).get("kv_load_failure_policy") or "fail")
        configured_id = (kv_config or {}).get("engine_id")
        self.engine_id = str(configured_id or "%s-%s-%d" % (role, host, port))
        side_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "")
        self.side_host = side_host or ("localhost" if host in ("", "0.0.0.0") else host)
        side_port = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "")
        self.side_port = int(side_port) if side_port else port
        self.abort_timeout = float(os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT") or 480)
        self.never_healthy = fault("LLMD_FAKE_ENGINE_NEVER_HEALTHY") == "1"
        self.hang = fault("LLMD_FAKE_ENGINE_HANG") == "1"
        # request id -> (engine id, block ids, expiry)
        self.kv: Dict[str, Tuple[str, List[int], float]] = {}
        self.lock = threading.Lock()
        self.requests = 0
        self.next_block = 0

    @property
    def producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both") if self.kv_config else True

    @property
    def consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both") if self.kv_config else True

    def keep_kv(self, rid: str, prompt_tokens: int) -> List[int]:
        """Allocate the prompt's blocks and keep them for a decode engine to fetch."""
        n = max(1, math.ceil(prompt_tokens / BLOCK_SIZE))
        now = time.monotonic()
        with self.lock:
            for old in [k for k, v in self.kv.items() if v[2] < now]:
                del self.kv[old]
            blocks = list(range(self.next_block, self.next_block + n))
            self.next_block += n
            self.kv[rid] = (self.engine_id, blocks, now + self.abort_timeout)
        return blocks

    def take_kv(self, rid: str, engine_id: Optional[str]) -> Optional[List[int]]:
        with self.lock:
            entry = self.kv.get(rid)
            if entry is None or (engine_id is not None and engine_id != entry[0]):
                return None
            del self.kv[rid]
            return entry[1]


def prompt_of(path: str, req: Dict[str, Any]) -> str:
    if path == "/v1/chat/completions":
        parts = []
        for m in req.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(str(content or ""))
        return " ".join(parts)
    prompt = req.get("prompt", "")
    if isinstance(prompt, list):
        return " ".join(str(p) for p in prompt)
    return str(prompt)


def fetch_kv(kv_in: Dict[str, Any]) -> Optional[str]:
    """Pull the KV stand-in named by ``kv_in``; None on success, else the reason."""
    query = ""
    if kv_in.get("remote_engine_id"):
        query = "?" + urllib.parse.urlencode({"engine_id": str(kv_in["remote_engine_id"])})
    url = "http://%s:%s/kv/%s%s" % (
        kv_in["remote_host"],
        kv_in["remote_port"],
        urllib.parse.quote(str(kv_in["remote_request_id"]), safe=""),
        query,
    )
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            got = json.loads(resp.read().decode("utf-8"))
    except Exception as exc:
        return "kv transfer from %s failed: %s" % (url, exc)
    want = kv_in.get("remote_block_ids")
    if want is not None and got.get("blocks") != want:
        return "kv transfer from %s: blocks %s, expected %s" % (url, got.get("blocks"), want)
    return None


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

        def _error(self, status: int, message: str, kind: str = "BadRequestError") -> None:
            self._send(status, {"error": {"message": message, "type": kind, "code": status}})

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _hang(self) -> None:
            while True:
                time.sleep(3600)

        def do_GET(self) -> None:
            if engine.hang:
                self._hang()
            path, _, query = self.path.partition("?")
            if path == "/health":
                if engine.never_healthy:
                    self._send(503, {"status": "starting"})
                else:
                    self._send(200, {"status": "ok", "role": engine.role})
            elif path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": engine.served_name}]})
            elif path.startswith("/kv/") and engine.producer:
                want = urllib.parse.parse_qs(query).get("engine_id", [None])[0]
                blocks = engine.take_kv(urllib.parse.unquote(path[4:]), want)
                if blocks is None:
                    self._send(404, {"error": "unknown request id"})
                else:
                    self._send(200, {"blocks": blocks, "engine_id": engine.engine_id})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            if engine.hang:
                self._hang()
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, {"error": "not found"})
                return
            length = int(self.headers.get("Content-Length", "0"))
            try:
                req = json.loads(self.rfile.read(length).decode("utf-8"))
                if not isinstance(req, dict):
                    raise ValueError("not an object")
            except ValueError:
                self._send(400, {"error": "bad json"})
                return
            if req.get("model") != engine.served_name:
                self._send(404, {"error": "model %r not served here" % req.get("model")})
                return
            prompt = prompt_of(self.path, req)
            limit = req.get("max_completion_tokens") or req.get("max_tokens") or 16
            max_tokens = int(limit)
            header_id = self.headers.get("x-request-id", "")
            with engine.lock:
                engine.requests += 1
                n = engine.requests
            rid = "cmpl-%s-%d" % (header_id, n) if header_id else "%s-%d" % (engine.engine_id, n)
            kv_in = req.get("kv_transfer_params") or {}
            if not isinstance(kv_in, dict):
                self._error(400, "kv_transfer_params must be an object")
                return
            prompt_tokens = len(prompt.split())
            kv_out: Optional[Dict[str, Any]] = None
            strict = engine.kv_config is not None
            if strict and kv_in.get("do_remote_decode"):
                leg = "prefill"
            elif strict and kv_in.get("do_remote_prefill"):
                leg = "decode"
            elif strict:
                leg = "local"
            else:
                leg = "prefill" if engine.role == "prefill" else "decode"
            detail = ""
            if leg == "prefill":
                if not engine.producer:
                    self._log(rid, leg, 400, "kv_consumer got a prefill leg")
                    self._error(400, "this engine is a kv_consumer: it cannot serve a prefill leg")
                    return
                max_tokens = 1  # the prefill leg: one token (the sidecar asks for one)
                blocks = engine.keep_kv(rid, prompt_tokens)
                kv_out = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": blocks,
                    "remote_engine_id": engine.engine_id,
                    "remote_request_id": rid,
                    "remote_host": engine.side_host,
                    "remote_port": engine.side_port,
                    "tp_size": 1,
                }
            elif leg == "decode" and strict:
                if not engine.consumer:
                    self._log(rid, leg, 400, "kv_producer got a decode leg")
                    self._error(400, "this engine is a kv_producer: it cannot serve a decode leg")
                    return
                missing = [f for f in REMOTE_FIELDS if kv_in.get(f) in (None, "", [])]
                if missing:
                    why = "kv_transfer_params lack %s: not from a prefill" % ", ".join(missing)
                    self._log(rid, leg, 400, why)
                    self._error(400, why)
                    return
                failure = fetch_kv(kv_in)
                detail = "from=%s:%s" % (kv_in["remote_host"], kv_in["remote_port"])
                if failure and engine.policy != "recompute":
                    self._log(rid, leg, 500, failure)
                    self._error(500, failure, "InternalServerError")
                    return
                if failure:
                    detail += " recomputed (%s)" % failure
            elif leg == "decode" and kv_in.get("remote_host"):  # the original stand-in path
                failure = fetch_kv(kv_in)
                if failure:
                    self._log(rid, leg, 502, failure)
                    self._send(502, {"error": failure})
                    return
                detail = "from=%s:%s" % (kv_in["remote_host"], kv_in["remote_port"])
            self._answer(req, rid, prompt_tokens, max_tokens, kv_out)
            self._log(rid, leg, 200, detail)

        def _log(self, rid: str, leg: str, status: int, detail: str) -> None:
            say("engine: request_id=%s leg=%s status=%d %s" % (rid, leg, status, detail))

        def _answer(
            self,
            req: Dict[str, Any],
            rid: str,
            prompt_tokens: int,
            max_tokens: int,
            kv_out: Optional[Dict[str, Any]],
        ) -> None:
            chat = self.path == "/v1/chat/completions"
            obj = "chat.completion" if chat else "text_completion"
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": max_tokens,
                "total_tokens": prompt_tokens + max_tokens,
            }
            text = "t" if max_tokens == 1 else " tok" * max_tokens
            if not req.get("stream"):
                time.sleep(0.001 * max_tokens)
                choice: Dict[str, Any] = {"index": 0, "finish_reason": "length"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                body: Dict[str, Any] = {
                    "id": rid,
                    "object": obj,
                    "model": engine.served_name,
                    "choices": [choice],
                    "usage": usage,
                }
                if kv_out is not None:
                    body["kv_transfer_params"] = kv_out
                self._send(200, body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            piece = "t" if max_tokens == 1 else " tok"
            for i in range(max_tokens):
                time.sleep(0.001)
                last = i == max_tokens - 1
                delta: Dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
                if chat:
                    delta["delta"] = {"content": piece}
                else:
                    delta["text"] = piece
                event: Dict[str, Any] = {
                    "id": rid,
                    "object": obj + (".chunk" if chat else ""),
                    "model": engine.served_name,
                    "choices": [delta],
                }
                if last and kv_out is not None:
                    event["kv_transfer_params"] = kv_out
                self._chunk(b"data: " + json.dumps(event).encode("utf-8") + b"\n\n")
            options = req.get("stream_options") or {}
            if isinstance(options, dict) and options.get("include_usage"):
                tail: Dict[str, Any] = {"id": rid, "object": obj, "model": engine.served_name}
                tail.update({"choices": [], "usage": usage})
                self._chunk(b"data: " + json.dumps(tail).encode("utf-8") + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

    return Handler


def parse_kv_config(text: str) -> Dict[str, Any]:
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise SystemExit("--kv-transfer-config: not JSON: %s" % exc) from None
    if not isinstance(cfg, dict):
        raise SystemExit("--kv-transfer-config: not a JSON object")
    if cfg.get("kv_role") not in KV_ROLES:
        raise SystemExit(
            "--kv-transfer-config: unsupported kv_role %r (one of %s)"
            % (cfg.get("kv_role"), ", ".join(KV_ROLES))
        )
    if cfg.get("kv_connector") != "NixlConnector":
        raise SystemExit(
            "--kv-transfer-config: the stand-in implements kv_connector NixlConnector only"
            " (got %r)" % cfg.get("kv_connector")
        )
    if cfg.get("kv_load_failure_policy", "fail") not in ("fail", "recompute"):
        raise SystemExit("--kv-transfer-config: kv_load_failure_policy is fail or recompute")
    return cfg


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="stand-in llm-d engine")
    parser.add_argument("model", nargs="?", help="vllm serve's MODEL (ignored)")
    parser.add_argument("--role", choices=("prefill", "decode"))
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-name", "--served-model-name", dest="served_name", required=True)
    parser.add_argument("--kv-transfer-config", "--kv_transfer_config", dest="kv_transfer_config")
    args = parser.parse_args(argv)
    kv_config = parse_kv_config(args.kv_transfer_config) if args.kv_transfer_config else None
    role = args.role
    if role is None:
        if kv_config is None:
            parser.error("give --role, or --kv-transfer-config with a kv_role")
        assert kv_config is not None
        role = "prefill" if kv_config["kv_role"] == "kv_producer" else "decode"

    if fault("LLMD_FAKE_ENGINE_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say("fault: ignoring SIGTERM")
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
            say("fault: crashing with rc %d" % CRASH_RC)
            os._exit(CRASH_RC)

        threading.Thread(target=crash, daemon=True).start()

    engine = Engine(role, args.served_name, args.host, args.port, kv_config)
    handler = make_handler(engine)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    server.daemon_threads = True
    if engine.side_port != args.port:
        side = ThreadingHTTPServer((args.host, engine.side_port), handler)
        side.daemon_threads = True
        threading.Thread(target=side.serve_forever, args=(0.2,), daemon=True).start()
    say(
        "stand-in %s engine serving %s on %s:%d (pid %d, kv_role %s, engine id %s,"
        " kv side channel %s:%d)"
        % (
            role,
            args.served_name,
            args.host,
            args.port,
            os.getpid(),
            engine.kv_role or "-",
            engine.engine_id,
            engine.side_host,
            engine.side_port,
        )
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
