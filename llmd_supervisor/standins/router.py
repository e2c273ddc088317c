"""Stand-in for the llm-d router on the coordinator -- Envoy and the EPP (endpoint picker)
in one process: stdlib only, Python 3.9+.

Endpoints come from a file in the EPP file-discovery format (llm-d-router
``docs/discovery.md``; tests/data/upstream/llm-d-router-discovery.md), YAML (the subset
``yaml.safe_dump`` and hand-written files use: block mappings and lists, quoted and plain
scalars, comments, JSON-style flow collections) or JSON::

    endpoints:
    - name: prefill-0            # required, unique within its namespace (last one wins)
      namespace: inferencex      # optional, default "default"
      address: 10.0.0.1          # a literal IPv4 address
      port: '8200'               # a string holding 1-65535 (a bare number fails the file,
      labels:                    #   as Go's unmarshalling into a string does upstream)
        llm-d.ai/role: prefill   # prefill | decode (and upstream's combined roles)

An endpoint is a prefill candidate when its ``llm-d.ai/role`` is ``prefill``,
``encode-prefill``, ``prefill-decode``, ``both`` or ``encode-prefill-decode``, and a decode
candidate when it is ``decode``, ``prefill-decode``, ``both``, ``encode-prefill-decode``
or unset (upstream's prefill-filter and decode-filter). An entry with a bad address or
port is logged and skipped; a file that cannot be read or parsed, or is over 1 MiB, is
logged and changes nothing (before the first good load the router is not ready). The file
is re-read whenever its inode, size or mtime changes (checked every ``--watch-interval``
s, 0.2): replace it by rename. ``--pool-namespace NS`` keeps only entries of namespace NS
(InferenceX says the EPP filters by it; off by default).

Routing (each ``POST``, e.g. ``/v1/completions`` and ``/v1/chat/completions``, and any
other ``GET``): a decode endpoint, then a prefill endpoint, each round robin in file order;
the request goes to the decode endpoint with ``x-prefiller-host-port: <prefill ip:port>``
(no header when there is no prefill endpoint: the decode side then does both phases),
``x-gateway-destination-endpoint: <decode ip:port>`` and ``x-request-id`` (the client's,
else a new UUID, as Envoy does); its answer is returned as it comes (streamed answers
too). No decode endpoint: 503. Decode endpoint unreachable: 503 with Envoy's
``upstream connect error or disconnect/reset before headers`` text.

Readiness -- what InferenceX waits for is Envoy's admin ``GET 127.0.0.1:9901/ready``
(``curl`` until 200), so the stand-in serves ``/ready`` on ``--admin-port`` (9901; 0: no
admin listener) on ``--admin-host`` (127.0.0.1), answering ``200 LIVE`` once listening and
the endpoints file has loaded, else ``503 PRE_INITIALIZING``. ``GET /health`` on the main
port answers the same (200/503 JSON); in the real stack /health on 8080 would be routed
through the EPP, which is why InferenceX does not use it. The admin port also serves
``GET /endpoints`` (the stand-in's own: the current prefill and decode lists, JSON).

Each routed request logs one line to stdout::

    router: request_id=<id> method=POST url=/v1/completions prefill=<ip:port>
      decode=<ip:port> status=200 ms=12.3

Flags: ``--port`` (Envoy's 8080), ``--host`` (0.0.0.0), ``--endpoints FILE`` (required),
``--admin-port``, ``--admin-host``, ``--watch-interval``, ``--request-timeout`` (600 s),
``--pool-namespace``; ``--pool-name`` is accepted and ignored.

Fault knob (environment; only on the ranks in ``LLMD_FAKE_FAULT_RANKS`` when set):
``LLMD_FAKE_ROUTER_NEVER_HEALTHY=1`` -- ``/ready`` and ``/health`` answer 503 forever
(routing still works).
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import re
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

if __package__:  # imported from the installed package (the tests)
    from .faults import fault, say
else:  # run from the job's node directory, where faults.py lies beside this file
    from faults import fault, say  # type: ignore[import-not-found,no-redef]

ROLE_LABEL = "llm-d.ai/role"
PREFILL_ROLES = ("prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode")
DECODE_ROLES = ("decode", "prefill-decode", "both", "encode-prefill-decode")
MAX_FILE = 1 << 20
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
UPSTREAM_ERROR = (
    b"upstream connect error or disconnect/reset before headers. reset reason: connection failure"
)


# --- a YAML subset ------------------------------------------------------------------------


class Quoted(str):
    """A scalar that was quoted in the file (always a string)."""


def _strip_comment(line: str) -> str:
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"" and (i == 0 or line[i - 1] in " :-[{,"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _scalar(text: str) -> Any:
    text = text.strip()
    if text.startswith("'") and text.endswith("'") and len(text) >= 2:
        return Quoted(text[1:-1].replace("''", "'"))
    if text.startswith('"') and text.endswith('"') and len(text) >= 2:
        return Quoted(json.loads(text))
    if text[:1] in "[{":
        return json.loads(text)  # flow collections: the JSON-compatible ones
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text)
    if re.fullmatch(r"[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?", text):
        return float(text)
    return text


def parse_yaml(text: str) -> Any:
    """Block mappings and sequences with scalar leaves; ValueError on anything else."""
    lines: List[Tuple[int, str]] = []
    for raw in text.splitlines():
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise ValueError("tab in indentation")
        line = _strip_comment(raw)
        if not line.strip() or line.strip() in ("---", "..."):
            continue
        indent = len(line) - len(line.lstrip(" "))
        body = line.strip()
        # "- key: value" is a sequence item holding a mapping: split it in two lines
        while body.startswith("- ") or body == "-":
            lines.append((indent, "-"))
            rest = body[1:].lstrip(" ")
            if not rest:
                break
            indent += len(body) - len(rest)
            body = rest
        else:
            lines.append((indent, body))
    if not lines:
        return None
    value, end = _block(lines, 0, lines[0][0])
    if end != len(lines):
        raise ValueError("bad indentation near %r" % lines[end][1])
    return value


def _block(lines: List[Tuple[int, str]], i: int, indent: int) -> Tuple[Any, int]:
    if lines[i][1] == "-":
        items: List[Any] = []
        while i < len(lines) and lines[i] == (indent, "-"):
            i += 1
            if i < len(lines) and lines[i][0] > indent:
                item, i = _block(lines, i, lines[i][0])
            else:
                item = None
            items.append(item)
        return items, i
    if ":" not in lines[i][1] and lines[i][0] == indent:
        return _scalar(lines[i][1]), i + 1
    mapping: Dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent and lines[i][1] != "-":
        key, sep, rest = _split_key(lines[i][1])
        if not sep:
            raise ValueError("expected 'key: value', got %r" % lines[i][1])
        i += 1
        if rest.strip():
            mapping[key] = _scalar(rest)
        elif i < len(lines) and (
            lines[i][0] > indent or (lines[i][0] == indent and lines[i][1] == "-")
        ):
            mapping[key], i = _block(lines, i, lines[i][0])
        else:
            mapping[key] = None
    return mapping, i


def _split_key(body: str) -> Tuple[str, str, str]:
    if body[:1] in "'\"":
        end = body.find(body[0], 1)
        if end < 0:
            raise ValueError("unterminated key in %r" % body)
        key = str(_scalar(body[: end + 1]))
        rest = body[end + 1 :]
        if not rest.startswith(":"):
            return key, "", ""
        return key, ":", rest[1:]
    m = re.match(r"(.*?):(\s|$)", body)
    if not m:
        return body, "", ""
    return m.group(1).strip(), ":", body[m.end() :]


# --- endpoints ----------------------------------------------------------------------------


class Endpoint(NamedTuple):
    namespace: str
    name: str
    address: str
    port: int
    role: Optional[str]

    @property
    def hostport(self) -> str:
        return "%s:%d" % (self.address, self.port)


def load_endpoints(path: str, namespace: Optional[str]) -> Tuple[List[Endpoint], List[str]]:
    """The file's endpoints, in file order, and the per-entry problems (skipped entries).
    Raises ValueError (or OSError) when the file as a whole is unusable."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_FILE + 1)
    if len(data) > MAX_FILE:
        raise ValueError("endpoints file %s exceeds 1 MiB limit" % path)
    text = data.decode("utf-8")
    doc = json.loads(text) if text.lstrip()[:1] == "{" else parse_yaml(text)
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ValueError("unmarshalling %s: not a mapping" % path)
    entries = doc.get("endpoints") or []
    if not isinstance(entries, list):
        raise ValueError("unmarshalling %s: endpoints is not a list" % path)
    found: Dict[Tuple[str, str], Endpoint] = {}
    problems: List[str] = []
    for e in entries:
        if not isinstance(e, dict):
            raise ValueError("unmarshalling %s: an endpoint is not a mapping" % path)
        for key in ("name", "namespace", "address", "port"):
            if e.get(key) is not None and not isinstance(e[key], str):
                raise ValueError(
                    "unmarshalling %s: endpoint %r: %s must be a string (got %r)"
                    % (path, e.get("name"), key, e[key])
                )
        labels = e.get("labels") or {}
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise ValueError("unmarshalling %s: labels must map strings to strings" % path)
        name = str(e.get("name") or "")
        try:
            address = str(ipaddress.IPv4Address(str(e.get("address") or "")))
        except ValueError:
            problems.append("endpoint %r: invalid IPv4 address %r" % (name, e.get("address")))
            continue
        port_text = str(e.get("port") or "")
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            problems.append("endpoint %r: invalid port %r" % (name, e.get("port")))
            continue
        ns = str(e.get("namespace") or "default")
        if namespace is not None and ns != namespace:
            problems.append(
                "endpoint %r: namespace %r is not the pool's %r" % (name, ns, namespace)
            )
            continue
        role = labels.get(ROLE_LABEL)
        found[(ns, name)] = Endpoint(ns, name, address, int(port_text), role)
    return list(found.values()), problems


class Router(object):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.prefill: List[Endpoint] = []
        self.decode: List[Endpoint] = []
        self.loaded = False
        self.stamp: Optional[Tuple[int, int, int]] = None
        self.counters = {"prefill": 0, "decode": 0}
        self.never_healthy = fault("LLMD_FAKE_ROUTER_NEVER_HEALTHY") == "1"
        self.timeout = float(args.request_timeout)

    @property
    def ready(self) -> bool:
        return self.loaded and not self.never_healthy

    def reload(self) -> None:
        try:
            st = os.stat(self.args.endpoints)
        except OSError as exc:
            if self.stamp is not None:
                say("router: endpoints file unreadable (%s); keeping the last" % exc)
                self.stamp = None
            return
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self.stamp:
            return
        self.stamp = stamp
        try:
            endpoints, problems = load_endpoints(self.args.endpoints, self.args.pool_namespace)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            say("router: failed to load the endpoints file: %s" % exc)
            return
        for p in problems:
            say("router: skipped %s" % p)
        prefill = [e for e in endpoints if e.role in PREFILL_ROLES]
        decode = [e for e in endpoints if e.role is None or e.role in DECODE_ROLES]
        with self.lock:
            self.prefill, self.decode, self.loaded = prefill, decode, True
        say(
            "router: endpoints loaded from %s: prefill %s; decode %s"
            % (
                self.args.endpoints,
                ",".join(e.hostport for e in prefill) or "-",
                ",".join(e.hostport for e in decode) or "-",
            )
        )

    def watch(self) -> None:
        while True:
            time.sleep(self.args.watch_interval)
            self.reload()

    def pick(self) -> Tuple[Optional[Endpoint], Optional[Endpoint]]:
        """(decode, prefill) for the next request, each round robin."""
        with self.lock:
            chosen: Dict[str, Optional[Endpoint]] = {}
            for role, pool in (("decode", self.decode), ("prefill", self.prefill)):
                if pool:
                    chosen[role] = pool[self.counters[role] % len(pool)]
                    self.counters[role] += 1
                else:
                    chosen[role] = None
            return chosen["decode"], chosen["prefill"]

    def snapshot(self) -> Dict[str, Any]:
        with self.lock:
            return {
                "loaded": self.loaded,
                "prefill": [e.hostport for e in self.prefill],
                "decode": [e.hostport for e in self.decode],
            }


def make_handler(router: Router, admin: bool) -> Any:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per routed request is written by route()

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if admin:
                if self.path == "/ready":
                    ok = router.ready
                    self._send(
                        200 if ok else 503, b"LIVE\n" if ok else b"PRE_INITIALIZING\n", "text/plain"
                    )
                elif self.path == "/endpoints":
                    self._send(200, json.dumps(router.snapshot()).encode(), "application/json")
                else:
                    self._send(404, b"not found\n", "text/plain")
                return
            if self.path == "/health":
                ok = router.ready
                body = json.dumps({"status": "ok" if ok else "not ready"}).encode()
                self._send(200 if ok else 503, body, "application/json")
                return
            self.route("GET")

        def do_POST(self) -> None:
            if admin:
                self._send(404, b"not found\n", "text/plain")
                return
            self.route("POST")

        def route(self, method: str) -> None:
            start = time.monotonic()
            length = int(self.headers.get("Content-Length", "0") or 0)
            body = self.rfile.read(length) if length else b""
            rid = self.headers.get("x-request-id") or str(uuid.uuid4())
            decode, prefill = router.pick()
            status = self._forward(method, body, rid, decode, prefill)
            say(
                "router: request_id=%s method=%s url=%s prefill=%s decode=%s status=%d ms=%.1f"
                % (
                    rid,
                    method,
                    self.path,
                    prefill.hostport if prefill else "-",
                    decode.hostport if decode else "-",
                    status,
                    (time.monotonic() - start) * 1000,
                )
            )

        def _forward(
            self,
            method: str,
            body: bytes,
            rid: str,
            decode: Optional[Endpoint],
            prefill: Optional[Endpoint],
        ) -> int:
            if decode is None:
                self._send(503, b"no decode endpoint available\n", "text/plain")
                return 503
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            for name in ("x-prefiller-host-port", "x-gateway-destination-endpoint", "x-request-id"):
                headers = {k: v for k, v in headers.items() if k.lower() != name}
            if prefill is not None:
                headers["x-prefiller-host-port"] = prefill.hostport
            headers["x-gateway-destination-endpoint"] = decode.hostport
            headers["x-request-id"] = rid
            conn = http.client.HTTPConnection(decode.address, decode.port, timeout=router.timeout)
            try:
                try:
                    conn.request(method, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                except OSError:
                    self._send(503, UPSTREAM_ERROR, "text/plain")
                    return 503
                self.send_response(resp.status)
                for key, value in resp.getheaders():
                    if key.lower() not in HOP_HEADERS:
                        self.send_header(key, value)
                if resp.getheader("Content-Length") is not None:
                    data = resp.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while True:
                        data = resp.read1(65536)
                        if not data:
                            break
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                return int(resp.status)
            finally:
                conn.close()

    return Handler


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="stand-in llm-d router (Envoy + EPP)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--endpoints", required=True)
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--admin-host", default="127.0.0.1")
    parser.add_argument("--watch-interval", type=float, default=0.2)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--pool-namespace")
    parser.add_argument("--pool-name")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))
    router = Router(args)
    router.reload()
    servers = [ThreadingHTTPServer((args.host, args.port), make_handler(router, False))]
    if args.admin_port:
        servers.append(
            ThreadingHTTPServer((args.admin_host, args.admin_port), make_handler(router, True))
        )
    for s in servers:
        s.daemon_threads = True
    threading.Thread(target=router.watch, daemon=True).start()
    for s in servers[1:]:
        threading.Thread(target=s.serve_forever, args=(0.2,), daemon=True).start()
    say(
        "stand-in router on %s:%d (admin %s), endpoints %s (pid %d)"
        % (
            args.host,
            args.port,
            "%s:%d" % (args.admin_host, args.admin_port) if args.admin_port else "off",
            args.endpoints,
            os.getpid(),
        )
    )
    try:
        servers[0].serve_forever(poll_interval=0.2)
    finally:
        for s in servers:
            s.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
