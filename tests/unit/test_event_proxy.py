"""Outbound events through a login node's HTTP proxy (issue 4.1, item 10): which proxy a
destination's URL goes through (`core.events.routing.proxy_for`: ``[events] proxy``, else
HTTPS_PROXY / HTTP_PROXY / ALL_PROXY, and NO_PROXY either way), ``[events] proxy`` in the
config, and deliveries through a real forwarding proxy on 127.0.0.1
(tests/fakes/http_proxy.py): http as an absolute-form request, https through CONNECT with
the system's trust store; and a daemon process whose ``events test`` goes through the
proxy of its environment, bypasses it for NO_PROXY, and prefers ``[events] proxy``."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.abc
import anyio.from_thread
import pytest

from llmd_supervisor.adapters.outbox.sender import post_json
from llmd_supervisor.core.events.delivery import HttpResponse, NetworkFailure
from llmd_supervisor.core.events.routing import parse_events, proxy_for
from llmd_supervisor.errors import ConfigErrors
from tests.daemon_helpers import Daemon, NoCluster
from tests.fakes.http_proxy import Proxy
from tests.fakes.webhook_receiver import Receiver
from tests.postgres import _make_tls
from tests.waiting import wait_until

P = "http://proxy.example:3128"
Q = "http://other.example:8080"

# (what, url, [events] proxy, environment, the proxy used)
CHOICES: list[tuple[str, str, str | None, dict[str, str], str | None]] = [
    ("no proxy anywhere", "https://hooks.slack.com/x", None, {}, None),
    ("HTTPS_PROXY", "https://hooks.slack.com/x", None, {"HTTPS_PROXY": P}, P),
    ("https_proxy first", "https://h/x", None, {"https_proxy": P, "HTTPS_PROXY": Q}, P),
    ("HTTPS_PROXY is not for http", "http://127.0.0.1:8/x", None, {"HTTPS_PROXY": P}, None),
    ("HTTP_PROXY for http", "http://127.0.0.1:8/x", None, {"HTTP_PROXY": P}, P),
    ("ALL_PROXY", "https://h/x", None, {"ALL_PROXY": P}, P),
    ("all_proxy after the scheme's", "https://h/x", None, {"all_proxy": Q, "HTTPS_PROXY": P}, P),
    ("no scheme: http", "https://h/x", None, {"HTTPS_PROXY": "proxy.example:3128"}, P),
    ("empty", "https://h/x", None, {"HTTPS_PROXY": " "}, None),
    ("[events] proxy wins", "https://h/x", Q, {"HTTPS_PROXY": P}, Q),
    ("[events] proxy alone", "http://127.0.0.1:8/x", Q, {}, Q),
    (
        "NO_PROXY domain",
        "https://hooks.slack.com/x",
        None,
        {"HTTPS_PROXY": P, "NO_PROXY": "slack.com"},
        None,
    ),
    (
        "no_proxy .domain",
        "https://hooks.slack.com/x",
        None,
        {"HTTPS_PROXY": P, "no_proxy": ".slack.com"},
        None,
    ),
    (
        "NO_PROXY .domain itself",
        "https://slack.com/x",
        None,
        {"HTTPS_PROXY": P, "NO_PROXY": ".slack.com"},
        None,
    ),
    (
        "NO_PROXY is not a suffix",
        "https://notslack.com/x",
        None,
        {"HTTPS_PROXY": P, "NO_PROXY": "slack.com"},
        P,
    ),
    ("NO_PROXY list", "https://h/x", None, {"HTTPS_PROXY": P, "NO_PROXY": "a, h ,b"}, None),
    ("NO_PROXY *", "https://h/x", None, {"HTTPS_PROXY": P, "NO_PROXY": "*"}, None),
    ("NO_PROXY other port", "https://h:8443/x", None, {"HTTPS_PROXY": P, "NO_PROXY": "h:443"}, P),
    ("NO_PROXY port", "https://h:8443/x", None, {"HTTPS_PROXY": P, "NO_PROXY": "h:8443"}, None),
    ("NO_PROXY default port", "https://h/x", None, {"HTTPS_PROXY": P, "NO_PROXY": "h:443"}, None),
    ("NO_PROXY CIDR", "http://10.1.2.3/x", None, {"HTTP_PROXY": P, "NO_PROXY": "10.0.0.0/8"}, None),
    (
        "NO_PROXY CIDR miss",
        "http://11.1.2.3/x",
        None,
        {"HTTP_PROXY": P, "NO_PROXY": "10.0.0.0/8"},
        P,
    ),
    ("NO_PROXY IPv6", "http://[::1]:80/x", None, {"HTTP_PROXY": P, "NO_PROXY": "::1"}, None),
    ("NO_PROXY [IPv6]", "http://[::1]:80/x", None, {"HTTP_PROXY": P, "NO_PROXY": "[::1]"}, None),
    (
        "NO_PROXY any case",
        "https://H.Example.ORG/x",
        None,
        {"HTTPS_PROXY": P, "NO_PROXY": "example.org"},
        None,
    ),
    ("NO_PROXY over [events] proxy", "https://h/x", Q, {"NO_PROXY": "h"}, None),
]


@pytest.mark.parametrize(
    ("url", "configured", "env", "used"), [c[1:] for c in CHOICES], ids=[c[0] for c in CHOICES]
)
def test_the_proxy_a_url_goes_through(
    url: str, configured: str | None, env: dict[str, str], used: str | None
) -> None:
    assert proxy_for(url, configured, env) == used


def test_events_proxy_in_the_config() -> None:
    assert parse_events({}).proxy is None
    assert parse_events({"proxy": "http://proxy.example:3128"}).proxy == "http://proxy.example:3128"
    assert (
        parse_events({"proxy": "https://u:pw@proxy.example"}).proxy == "https://u:pw@proxy.example"
    )


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        (3128, "an http:// or https:// URL"),
        ("socks5://proxy.example:1080", "an http:// or https:// URL"),
        ("http://", "an http:// or https:// URL"),
        ("http://proxy.example:99999", "an http:// or https:// URL"),
        ("http://proxy.example:3128/path", "no path"),
        ("ftp://u:s3cret@proxy.example", "an http:// or https:// URL"),
        ("http://u:s3cret@proxy.example/p?q", "no path"),
    ],
)
def test_a_bad_events_proxy_is_refused_without_its_password(value: object, hint: str) -> None:
    with pytest.raises(ConfigErrors) as info:
        parse_events({"proxy": value})
    message = str(info.value)
    assert "events.proxy" in message and hint in message, message
    assert "s3cret" not in message and "s3cret" not in repr(info.value.value)


@pytest.mark.asyncio
async def test_an_http_delivery_goes_through_the_proxy() -> None:
    proxy, receiver = Proxy(), Receiver()
    async with anyio.create_task_group() as tg:
        pport, rport = await tg.start(proxy.serve), await tg.start(receiver.serve)
        with anyio.fail_after(20):
            got = await post_json(
                f"http://127.0.0.1:{rport}/hooks?x=1",
                b'{"a":1}',
                {"webhook-id": "msg_1"},
                10,
                f"http://u:pw@127.0.0.1:{pport}",
            )
        tg.cancel_scope.cancel()
    assert got == HttpResponse(200, None)
    assert proxy.seen == [f"POST http://127.0.0.1:{rport}/hooks?x=1 HTTP/1.1"]
    assert proxy.authorizations == ["Basic " + base64.b64encode(b"u:pw").decode()]
    (request,) = receiver.got
    assert (request.target, request.body, request.headers["webhook-id"]) == (
        "/hooks?x=1",
        b'{"a":1}',
        "msg_1",
    )
    assert request.headers["user-agent"].startswith("llmd-supervisor/")
    assert "proxy-authorization" not in request.headers


@pytest.mark.asyncio
async def test_an_https_delivery_tunnels_through_the_proxy_and_trusts_the_system_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _make_tls(tmp_path, ("127.0.0.1",), {})
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "tls" / "server.crt", tmp_path / "tls" / "server.key")
    proxy, receiver = Proxy(), Receiver()
    async with anyio.create_task_group() as tg:
        pport = await tg.start(proxy.serve)
        rport = await tg.start(
            lambda task_status: receiver.serve(tls=server, task_status=task_status)
        )
        url, via = f"https://127.0.0.1:{rport}/hook", f"http://127.0.0.1:{pport}"
        with anyio.fail_after(20):
            # The test CA is not in the system's store: the receiver is not trusted ...
            untrusted = await post_json(url, b"{}", {}, 10, via)
            # ... until OpenSSL's default paths (the system store) hold it.
            monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "tls" / "ca.crt"))
            trusted = await post_json(url, b"{}", {}, 10, via)
        tg.cancel_scope.cancel()
    assert isinstance(untrusted, NetworkFailure), untrusted
    assert (
        untrusted.what.startswith("TLS failed: ") and "CERTIFICATE_VERIFY_FAILED" in untrusted.what
    )
    assert trusted == HttpResponse(200, None)
    assert proxy.seen == [f"CONNECT 127.0.0.1:{rport} HTTP/1.1"] * 2
    assert len(receiver.got) == 1


@pytest.mark.parametrize(
    ("proxy", "said"),
    [
        ("http://u:s3cret@127.0.0.1:{port}", "the proxy http://127.0.0.1:{port} cannot be reached"),
        (
            "socks5://u:s3cret@127.0.0.1:{port}",
            "the proxy socks5://127.0.0.1:{port} cannot be used",
        ),
        ("ftp://u:s3cret@127.0.0.1:{port}", "the proxy ftp://127.0.0.1:{port} cannot be used"),
    ],
)
@pytest.mark.asyncio
async def test_a_dead_or_unusable_proxy_is_a_network_failure_naming_it_without_its_password(
    proxy: str, said: str
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = closed.getsockname()[1]
        with anyio.fail_after(20):
            got = await post_json("http://127.0.0.1:9/hook", b"{}", {}, 10, proxy.format(port=port))
    assert isinstance(got, NetworkFailure), got
    assert said.format(port=port) in got.what and "s3cret" not in got.what, got.what


# --- through the daemon -------------------------------------------------------------------


@pytest.fixture
def servers() -> Iterator[tuple[anyio.from_thread.BlockingPortal, Proxy, int, Receiver, int]]:
    """A proxy and a receiver on loopback, served in a thread of their own."""
    proxy, receiver = Proxy(), Receiver()
    with anyio.from_thread.start_blocking_portal() as portal:

        async def serve(
            *, task_status: anyio.abc.TaskStatus[tuple[anyio.CancelScope, int, int]]
        ) -> None:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    ports = await tg.start(proxy.serve), await tg.start(receiver.serve)
                    task_status.started((scope, *ports))

        future, (scope, pport, rport) = portal.start_task(serve)
        try:
            yield portal, proxy, pport, receiver, rport
        finally:
            portal.call(scope.cancel)
            future.result(timeout=10)


@pytest.mark.parametrize(
    ("config_proxy", "env", "through"),
    [
        (None, {"HTTP_PROXY": "{proxy}"}, True),
        (None, {"http_proxy": "{proxy}", "NO_PROXY": "localhost,127.0.0.1"}, False),
        ("{proxy}", {"HTTP_PROXY": "http://127.0.0.1:9"}, True),
    ],
    ids=["environment", "NO_PROXY", "[events] proxy over the environment"],
)
def test_a_daemon_s_events_test_goes_through_its_proxy(
    servers: tuple[anyio.from_thread.BlockingPortal, Proxy, int, Receiver, int],
    tmp_path: Path,
    config_proxy: str | None,
    env: dict[str, str],
    through: bool,
) -> None:
    portal, proxy, pport, receiver, rport = servers
    via = f"http://127.0.0.1:{pport}"
    secret_file = tmp_path / "ci.whsec"
    secret_file.write_text("whsec_" + base64.b64encode(bytes(range(32))).decode() + "\n")
    secret_file.chmod(0o600)
    proxy_line = "" if config_proxy is None else f'proxy = "{config_proxy.format(proxy=via)}"'
    d = Daemon(
        NoCluster(tmp_path),
        tmp_path,
        env={k: v.format(proxy=via) for k, v in env.items()},
        extra_config=f"""
[events]
{proxy_line}

[[events.destination]]
name = "ci"
kind = "webhook"
url = "http://127.0.0.1:{rport}/hooks/llmd"
secret_file = "{secret_file}"
""",
    )
    d.start()
    try:
        sent = d.cli("events", "test", "ci", "--json")
        assert sent.returncode == 0, sent.stderr
        event = json.loads(sent.stdout)["event"]
        wait_until(lambda: portal.call(lambda: len(receiver.got)) >= 1, 60, "no ping")
        (ping,) = portal.call(lambda: list(receiver.got))
        seen = portal.call(lambda: list(proxy.seen))
    finally:
        assert d.stop() == 0
    assert ping.headers["webhook-id"] == event
    expected = [f"POST http://127.0.0.1:{rport}/hooks/llmd HTTP/1.1"] if through else []
    assert seen == expected, d.log_text()[-2000:]


def test_the_daemon_s_start_says_which_proxy_and_never_its_password(tmp_path: Path) -> None:
    d = Daemon(
        NoCluster(tmp_path),
        tmp_path,
        extra_config="""
[events]
proxy = "http://u:s3cret@proxy.example:3128"

[[events.destination]]
name = "slack"
kind = "slack"
url = "https://hooks.slack.com/services/T/B/x"
""",
    )
    d.start()
    try:
        (started,) = d.events("events.sender_started")
    finally:
        d.stop()
    shown = subprocess.run(
        [sys.executable, "-m", "llmd_supervisor", "config", "show", "--config", str(d.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert started["proxy"] == "http://proxy.example:3128"
    assert "s3cret" not in d.log_text() and "s3cret" not in shown.stdout + shown.stderr
    assert "http://proxy.example:3128" in shown.stdout
