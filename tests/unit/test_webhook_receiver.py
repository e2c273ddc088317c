"""deploy/webhook-receiver (the quickstart's events destination) accepts exactly what the
daemon signs, once per webhook-id, and refuses forged or stale deliveries."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd_supervisor.core.events.webhooks import parse_secret, webhook_headers
from tests.devcluster import REPO

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    secret = tmp_path / "hook.whsec"
    secret.write_text(SECRET + "\n")
    out, port_file = tmp_path / "events.jsonl", tmp_path / "port"
    argv = [str(REPO / "deploy" / "webhook-receiver"), "--secret-file", str(secret)]
    argv += ["--out", str(out), "--port-file", str(port_file)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the receiver wrote no port file in 30 s"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text().strip()}/hooks/llmd", out
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_signed_event_is_kept_once_and_forged_or_stale_ones_are_refused(
    receiver: tuple[str, Path],
) -> None:
    url, out = receiver
    key = parse_secret(SECRET, "test")
    body = json.dumps({"type": "run.finished", "data": {"outcome": "succeeded"}}).encode()
    now = int(time.time())
    headers = webhook_headers([key], "msg_1", now, body)
    assert post(url, body, headers) == 204
    assert post(url, body, headers) == 204  # a redelivery: answered, not kept twice
    other = parse_secret("whsec_" + base64.b64encode(os.urandom(32)).decode(), "other")
    assert post(url, body, webhook_headers([other], "msg_2", now, body)) == 400
    assert post(url, body, webhook_headers([key], "msg_3", now - 3600, body)) == 400
    assert post(url, body + b" ", headers) == 400  # the body changed after signing
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["webhook_id"], line["event"]["type"]) for line in lines] == [
        ("msg_1", "run.finished")
    ]
