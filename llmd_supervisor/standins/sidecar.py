"""Stand-in for llm-d's P/D sidecar (``pd-sidecar``) on a decode node: stdlib only, 3.9+.

It listens on ``--port`` (8000) in front of the local decode engine on
``127.0.0.1:--vllm-port`` (8200) and implements the NIXL v2 protocol of
llm-d-router's ``pkg/sidecar/proxy/connector_nixlv2.go``
(tests/data/upstream/llm-d-router-sidecar.md):

* ``POST /v1/completions``, ``/v1/chat/completions``: when the request carries
  ``x-prefiller-host-port`` (set by the router; several values, or one comma-separated
  value, are candidates: the first is taken, or a random one with
  ``--enable-prefiller-sampling``), the header is removed and

  1. the prefill leg goes to ``http://<that host:port><same path>`` with header
     ``x-request-id: <new uuid>``, ``stream`` false, ``stream_options`` removed,
     ``max_tokens``, ``max_completion_tokens`` and ``min_tokens`` set to 1 and
     ``kv_transfer_params`` ``{do_remote_decode: true, do_remote_prefill: false,
     remote_engine_id: null, remote_block_ids: null, remote_host: null, remote_port:
     null}``; an error status (after ``--prefill-max-retries`` retries of 502/503/504,
     ``--prefill-retry-backoff`` apart) is returned to the client as it came;
  2. the decode leg is the client's own request (its token limits and stream settings)
     with the ``kv_transfer_params`` the prefill answered, sent with the same
     ``x-request-id`` to the local engine, whose answer (streamed or not) is returned.

  Without the header the request goes to the local engine unchanged: decode does both
  phases. Any other path is passed to the local engine as it is.
* ``GET /health``: 200, empty body (upstream's handler), once listening.

Each request logs one line to stdout::

    sidecar: request_id=<uuid> client_request_id=<x-request-id in> path=prefill->decode
      prefill=<host:port> prefill_status=200 decode=127.0.0.1:8200 status=200 ms=12.3

(``path=decode-only`` and ``prefill=-`` without the header.)

Flags: pd-sidecar's names, ``--flag=value`` or ``--flag value``, booleans bare or
``=true|false``: ``--port``, ``--model-server-port`` and its deprecated alias
``--vllm-port``, ``--kv-connector`` (``nixlv2`` only; the other upstream names are refused
as not implemented), ``--secure-proxy`` (upstream's default is true, serving TLS with
``--cert-path``/tls.crt + tls.key, else a self-signed certificate the stand-in cannot make:
pass ``--secure-proxy=false`` or a ``--cert-path``), ``--enable-prefiller-sampling`` (or
``ENABLE_PREFILLER_SAMPLING``), ``--prefill-max-retries``, ``--prefill-retry-backoff``
(Go duration: ``200ms``, ``1s``); accepted and ignored: ``--data-parallel-size``,
``--ec-connector``, ``--mooncake-bootstrap-port``, ``--p2p-connector-port``,
``--enable-p2p-pull``, ``--enable-ssrf-protection``, ``--enable-tls``,
``--tls-insecure-skip-verify``, ``--inference-pool``, ``--pool-group``,
``--max-idle-conns-per-host``, ``--decode-chunk-size``, ``--configuration``,
``--configuration-file``, ``--tracing``, ``--metrics-port``, the ``--moriio-*`` flags and
zap's ``--zap-*`` logging flags. Also ``--host`` (the stand-in's own; default 0.0.0.0)
and ``--request-timeout`` (seconds per leg, default 600).

Fault knobs (environment; only on the ranks in ``LLMD_FAKE_FAULT_RANKS`` when set):

* ``LLMD_FAKE_SIDECAR_CRASH_AFTER_S=N``: exit with rc 3 N seconds after start;
* ``LLMD_FAKE_SIDECAR_DROP_PREFILL=1``: skip the prefill leg; the decode leg carries
  ``kv_transfer_params`` ``{do_remote_prefill: true, do_remote_decode: false}`` with every
  ``remote_*`` field null -- transfer parameters no prefill filled in -- so a decode engine
  started as a KV consumer refuses it (400) and the client sees that status.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import ssl
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

if __package__:  # imported from the installed package (the tests)
    from .faults import fault, say
else:  # run from the job's node directory, where faults.py lies beside this file
    from faults import fault, say  # type: ignore[import-not-found,no-redef]

CRASH_RC = 3
PREFILL_HEADER = "x-prefiller-host-port"
REQUEST_ID_HEADER = "x-request-id"
KV_CONNECTORS = ("nixlv2", "shared-storage", "sglang", "mooncake", "offloading")
TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")
PD_PATHS = ("/v1/completions", "/v1/chat/completions")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
IGNORED_VALUE_FLAGS = (
    "data-parallel-size",
    "ec-connector",
    "mooncake-bootstrap-port",
    "p2p-connector-port",
    "enable-tls",
    "tls-insecure-skip-verify",
    "inference-pool",
    "pool-group",
    "max-idle-conns-per-host",
    "decode-chunk-size",
    "configuration",
    "configuration-file",
    "metrics-port",
    "moriio-decode-notify-port",
    "moriio-local-pod-ip",
    "moriio-decode-handshake-port",
    "moriio-parallel-decode-wait-timeout",
    "moriio-prefill-handshake-port",
    "moriio-prefill-notify-port",
    "moriio-tp-size",
    "moriio-dp-size",
    "moriio-remote-hosts",
    "moriio-dp-size-local",
    "moriio-decode-hosts",
    "zap-log-level",
    "zap-encoder",
    "zap-stacktrace-level",
    "zap-time-encoding",
    "kubeconfig",
)
IGNORED_BOOL_FLAGS = (
    "enable-p2p-pull",
    "enable-ssrf-protection",
    "tracing",
    "moriio-write-mode",
    "moriio-parallel-dispatch",
    "zap-devel",
)


def go_bool(text: str) -> bool:
    """strconv.ParseBool's spellings."""
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise argparse.ArgumentTypeError("not a boolean: %r" % text)


def go_duration(text: str) -> float:
    """A Go time.Duration (``200ms``, ``1.5s``, ``1m30s``) in seconds."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", text)
    if text == "0":
        return 0.0
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError("not a Go duration: %r" % text)
    return sum(float(n) * units[u] for n, u in parts)


def split_host_port(value: str) -> Tuple[str, int]:
    value = value.strip()
    if value.startswith("http://"):
        value = value[len("http://") :]
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError("not host:port: %r" % value)
    return host.strip("[]"), int(port)


class Sidecar(object):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.decoder = ("127.0.0.1", int(args.model_server_port))
        self.sampling = bool(args.enable_prefiller_sampling)
        self.drop_prefill = fault("LLMD_FAKE_SIDECAR_DROP_PREFILL") == "1"
        self.timeout = float(args.request_timeout)

    @property
    def decoder_name(self) -> str:
        return "%s:%d" % self.decoder


def make_handler(car: Sidecar) -> Any:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request is written by _log

        def _log(self, **fields: Any) -> None:
            text = " ".join("%s=%s" % (k, "-" if v is None else v) for k, v in fields.items())
            say("sidecar: " + text)

        def _send_bytes(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            body = json.dumps({"error": {"message": message, "code": status}}).encode("utf-8")
            self._send_bytes(status, body, "application/json")

        def _forward_headers(self, request_id: Optional[str]) -> Dict[str, str]:
            out: Dict[str, str] = {}
            for key, value in self.headers.items():
                low = key.lower()
                if low in HOP_HEADERS or low == PREFILL_HEADER:
                    continue
                out[key] = value
            if request_id is not None:
                # upstream Adds its own id beside the incoming one; one value is kept here
                out = {k: v for k, v in out.items() if k.lower() != REQUEST_ID_HEADER}
                out[REQUEST_ID_HEADER] = request_id
            return out

        def _open(
            self, target: Tuple[str, int], method: str, body: bytes, headers: Dict[str, str]
        ) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
            conn = http.client.HTTPConnection(target[0], target[1], timeout=car.timeout)
            conn.request(method, self.path, body=body, headers=headers)
            return conn, conn.getresponse()

        def _relay(self, resp: http.client.HTTPResponse) -> None:
            """Pass an upstream answer on: its status, headers and body (chunk by chunk
            when it has no length, e.g. server-sent events)."""
            self.send_response(resp.status)
            for key, value in resp.getheaders():
                if key.lower() not in HOP_HEADERS:
                    self.send_header(key, value)
            length = resp.getheader("Content-Length")
            if length is not None:
                data = resp.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                data = resp.read1(65536)
                if not data:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def _pass_through(self, method: str, body: bytes) -> int:
            try:
                conn, resp = self._open(car.decoder, method, body, self._forward_headers(None))
            except OSError as exc:
                self._error(502, "decode engine %s: %s" % (car.decoder_name, exc))
                return 502
            try:
                self._relay(resp)
            finally:
                conn.close()
            return int(resp.status)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._pass_through("GET", b"")

        def do_POST(self) -> None:
            start = time.monotonic()
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
            client_id = self.headers.get(REQUEST_ID_HEADER)
            if self.path not in PD_PATHS:
                status = self._pass_through("POST", raw)
                self._log(path="passthrough", url=self.path, status=status)
                return
            candidates: List[str] = []
            for value in self.headers.get_all(PREFILL_HEADER) or []:
                candidates += [v.strip() for v in value.split(",") if v.strip()]
            prefill = ""
            if candidates:
                prefill = random.choice(candidates) if car.sampling else candidates[0]
            if not prefill:
                status = self._pass_through("POST", raw)
                self._log(
                    request_id=None,
                    client_request_id=client_id,
                    path="decode-only",
                    prefill=None,
                    decode=car.decoder_name,
                    status=status,
                    ms="%.1f" % ((time.monotonic() - start) * 1000),
                )
                return
            try:
                req = json.loads(raw.decode("utf-8"))
                if not isinstance(req, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                self._error(400, "invalid JSON body: %s" % exc)
                return
            rid = str(uuid.uuid1())
            fields: Dict[str, Any] = {
                "request_id": rid,
                "client_request_id": client_id,
                "path": "prefill->decode",
                "prefill": prefill,
            }
            if car.drop_prefill:
                fields["path"] = "decode-only(prefill dropped)"
                fields["prefill_status"] = "dropped"
                kv_params: Any = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": None,
                    "remote_block_ids": None,
                    "remote_host": None,
                    "remote_port": None,
                }
            else:
                ok, kv_params = self._prefill_leg(req, prefill, rid, fields)
                if not ok:
                    fields["ms"] = "%.1f" % ((time.monotonic() - start) * 1000)
                    self._log(**fields)
                    return
            decode_req = dict(req)
            decode_req["kv_transfer_params"] = kv_params
            body = json.dumps(decode_req).encode("utf-8")
            headers = self._forward_headers(rid)
            headers["Content-Type"] = "application/json"
            fields["decode"] = car.decoder_name
            try:
                conn, resp = self._open(car.decoder, "POST", body, headers)
            except OSError as exc:
                self._error(502, "decode engine %s: %s" % (car.decoder_name, exc))
                fields["status"] = 502
            else:
                try:
                    self._relay(resp)
                finally:
                    conn.close()
                fields["status"] = resp.status
            fields["ms"] = "%.1f" % ((time.monotonic() - start) * 1000)
            self._log(**fields)

        def _prefill_leg(
            self, req: Dict[str, Any], prefill: str, rid: str, fields: Dict[str, Any]
        ) -> Tuple[bool, Any]:
            """Run the prefill leg: (True, its kv_transfer_params), or (False, None) once
            the client has been answered with the error."""
            preq = dict(req)
            preq["kv_transfer_params"] = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            preq["stream"] = False
            preq.pop("stream_options", None)
            for name in TOKEN_LIMIT_FIELDS:
                preq[name] = 1
            body = json.dumps(preq).encode("utf-8")
            headers = self._forward_headers(rid)
            headers["Content-Type"] = "application/json"
            try:
                target = split_host_port(prefill)
            except ValueError as exc:
                self._error(502, str(exc))
                fields["prefill_status"] = 502
                return False, None
            attempt = 0
            while True:
                try:
                    conn, resp = self._open(target, "POST", body, headers)
                    try:
                        status, data = int(resp.status), resp.read()
                        ctype = resp.getheader("Content-Type") or "application/json"
                    finally:
                        conn.close()
                except OSError as exc:
                    status, ctype = 502, "application/json"
                    data = json.dumps({"error": "prefill %s: %s" % (prefill, exc)}).encode()
                if status not in (502, 503, 504) or attempt >= car.args.prefill_max_retries:
                    break
                attempt += 1
                time.sleep(car.args.prefill_retry_backoff)
            fields["prefill_status"] = status
            if status >= 400:
                self._send_bytes(status, data, ctype)
                return False, None
            try:
                answer = json.loads(data.decode("utf-8"))
            except ValueError as exc:
                self._error(500, "prefill %s answered no JSON: %s" % (prefill, exc))
                return False, None
            if not isinstance(answer, dict):
                self._error(500, "prefill %s answered no JSON object" % prefill)
                return False, None
            if "kv_transfer_params" not in answer:  # upstream warns and goes on with null
                say("sidecar: warning: no kv_transfer_params in the prefill answer")
            return True, answer.get("kv_transfer_params")

    return Handler


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="stand-in llm-d P/D sidecar")

    def flag_bool(name: str, default: bool) -> None:
        parser.add_argument(
            "--" + name,
            nargs="?",
            const=True,
            default=default,
            type=go_bool,
            dest=name.replace("-", "_"),
        )

    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--model-server-port", type=int)
    parser.add_argument("--vllm-port", type=int, default=8200)
    parser.add_argument("--kv-connector", default="nixlv2")
    parser.add_argument("--cert-path")
    parser.add_argument("--prefill-max-retries", type=int, default=0)
    parser.add_argument("--prefill-retry-backoff", type=go_duration, default=0.2)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    env_sampling = os.environ.get("ENABLE_PREFILLER_SAMPLING", "")
    try:
        sampling_default = go_bool(env_sampling) if env_sampling else False
    except argparse.ArgumentTypeError:
        sampling_default = False
    flag_bool("secure-proxy", True)
    flag_bool("enable-prefiller-sampling", sampling_default)
    for name in IGNORED_BOOL_FLAGS:
        flag_bool(name, False)
    for name in IGNORED_VALUE_FLAGS:
        parser.add_argument("--" + name, action="append")
    args = parser.parse_args(argv)
    if args.model_server_port is None:
        args.model_server_port = args.vllm_port
    if args.kv_connector not in KV_CONNECTORS:
        parser.error("--kv-connector must be one of: %s" % ", ".join(KV_CONNECTORS))
    if args.kv_connector != "nixlv2":
        parser.error("the stand-in implements --kv-connector=nixlv2 only")
    if args.prefill_max_retries > 0 and args.prefill_retry_backoff <= 0:
        parser.error("--prefill-retry-backoff must be positive when --prefill-max-retries > 0")
    if args.secure_proxy and not args.cert_path:
        parser.error(
            "--secure-proxy is true (upstream's default) and no --cert-path: the stand-in"
            " cannot make a self-signed certificate; pass --secure-proxy=false"
        )
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))
    crash_after = fault("LLMD_FAKE_SIDECAR_CRASH_AFTER_S")
    if crash_after:

        def crash() -> None:
            time.sleep(float(crash_after))
            say("fault: sidecar crashing with rc %d" % CRASH_RC)
            os._exit(CRASH_RC)

        threading.Thread(target=crash, daemon=True).start()
    car = Sidecar(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(car))
    server.daemon_threads = True
    if args.secure_proxy:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(
            os.path.join(args.cert_path, "tls.crt"), os.path.join(args.cert_path, "tls.key")
        )
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    say(
        "stand-in pd-sidecar on %s:%d -> decode engine %s (kv-connector %s, prefiller"
        " sampling %s, pid %d)"
        % (
            args.host,
            args.port,
            car.decoder_name,
            args.kv_connector,
            "on" if car.sampling else "off",
            os.getpid(),
        )
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
