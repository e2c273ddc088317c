"""Standard Webhooks 1.0 signing and verification (`core.events.webhooks`; what of the spec is
relied on: tests/data/standard-webhooks/SOURCE.md)."""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import UTC, datetime, timedelta, timezone

import pytest

from llmd_supervisor.core.events.webhooks import (
    KEYS_MAX,
    TOLERANCE_S,
    SigningKey,
    parse_secret,
    parse_secret_file,
    sign,
    signed_content,
    unix_seconds,
    verify,
    webhook_headers,
)
from llmd_supervisor.errors import WebhookSecretError, WebhookSignatureError

# The spec's reference library's own vector (test_sign_function; SOURCE.md).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))
SECRET_A = "whsec_" + base64.b64encode(KEY_A).decode()
SECRET_B = "whsec_" + base64.b64encode(KEY_B).decode()
EVT = "evt_ifkrqdar5cyokhisfzcmftq4iy"
BODY = b'{"data":{},"id":"evt_ifkrqdar5cyokhisfzcmftq4iy","type":"test.ping"}'
NOW = 1_750_000_000


def _independent(key: bytes, msg_id: str, ts: int, body: bytes) -> str:
    """Standard Webhooks v1 written again from the spec, not from the module."""
    mac = hmac.new(key, msg_id.encode() + b"." + str(ts).encode() + b"." + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def test_the_published_vector() -> None:
    key = parse_secret(VECTOR_SECRET, "vector")
    assert sign([key], VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIG
    assert _independent(key.key, VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIG
    headers = {
        "webhook-id": VECTOR_ID,
        "webhook-timestamp": str(VECTOR_TS),
        "webhook-signature": VECTOR_SIG,
    }
    verify([key], headers, VECTOR_BODY, now=VECTOR_TS)
    # the reference tests' "invalid signature": one character off
    headers["webhook-signature"] = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OA="
    with pytest.raises(WebhookSignatureError, match="no v1 signature"):
        verify([key], headers, VECTOR_BODY, now=VECTOR_TS)


def test_headers_of_one_attempt_and_rotation() -> None:
    a, b = parse_secret(SECRET_A, "f"), parse_secret(SECRET_B, "f")
    assert webhook_headers([a, b], EVT, NOW, BODY) == {
        "webhook-id": EVT,
        "webhook-timestamp": str(NOW),
        # one signature per key, in file order, one space apart
        "webhook-signature": _independent(KEY_A, EVT, NOW, BODY)
        + " "
        + _independent(KEY_B, EVT, NOW, BODY),
    }
    headers = webhook_headers([a, b], EVT, NOW, BODY)
    verify([a], headers, BODY, NOW)  # a receiver still on the old key
    verify([b], headers, BODY, NOW)  # one already on the new key
    verify([b, a], headers, BODY, NOW)
    # a retry: same id, new timestamp, new signature
    later = webhook_headers([a], EVT, NOW + 30, BODY)
    assert later["webhook-id"] == headers["webhook-id"]
    assert later["webhook-signature"] != headers["webhook-signature"].split(" ")[0]


def test_signed_content_is_id_dot_timestamp_dot_body() -> None:
    assert signed_content("evt_x", 12, b"{}") == b"evt_x.12.{}"
    for bad_id in ("", "a.b", "evt x", "é", "x" * 257):
        with pytest.raises(ValueError, match="is not 1-256 of"):
            signed_content(bad_id, 12, b"{}")
    for bad_ts in (-1, True):
        with pytest.raises(ValueError, match="not a non-negative integer"):
            signed_content("evt_x", bad_ts, b"{}")
    with pytest.raises(ValueError, match="at least one key"):
        sign([], "evt_x", 1, b"{}")


def _headers(**override: str) -> dict[str, str]:
    h = webhook_headers([parse_secret(SECRET_A, "f")], EVT, NOW, BODY)
    h.update(override)
    return {k: v for k, v in h.items() if v != "-"}


@pytest.mark.parametrize(
    ("headers", "body", "now", "why"),
    [
        (_headers(), BODY + b" ", NOW, "no v1 signature in webhook-signature matches any of"),
        (_headers(**{"webhook-id": "evt_other"}), BODY, NOW, "no v1 signature"),
        (_headers(**{"webhook-timestamp": str(NOW + 1)}), BODY, NOW, "no v1 signature"),
        (_headers(**{"webhook-id": "-"}), BODY, NOW, "the webhook-id header is missing"),
        (_headers(**{"webhook-timestamp": ""}), BODY, NOW, "webhook-timestamp header is miss"),
        (_headers(**{"webhook-signature": "-"}), BODY, NOW, "webhook-signature header is miss"),
        (_headers(**{"webhook-timestamp": "1.5"}), BODY, NOW, "not an integer number of sec"),
        (_headers(**{"webhook-timestamp": "-5"}), BODY, NOW, "not an integer number of sec"),
        (_headers(), BODY, NOW + TOLERANCE_S + 1, r"is 301 s old; at most 300 s"),
        (_headers(), BODY, NOW - TOLERANCE_S - 1, r"is 301 s ahead of this clock"),
        (_headers(**{"webhook-id": "a.b"}), BODY, NOW, "webhook-id 'a.b' is not 1-256"),
        (_headers(**{"webhook-signature": "v1a,AAAA v2,xx"}), BODY, NOW, "no v1 signature"),
        (_headers(**{"webhook-signature": "v1,not base64!"}), BODY, NOW, "no v1 signature"),
        (_headers(**{"webhook-signature": "v1"}), BODY, NOW, "no v1 signature"),
    ],
)
def test_what_does_not_verify(headers: dict[str, str], body: bytes, now: int, why: str) -> None:
    with pytest.raises(WebhookSignatureError, match=why):
        verify([parse_secret(SECRET_A, "f")], headers, body, now)


def test_what_verifies() -> None:
    a = parse_secret(SECRET_A, "f")
    verify([a], _headers(), BODY, NOW)
    verify([a], _headers(), BODY, NOW + TOLERANCE_S)  # the tolerance is inclusive
    verify([a], _headers(), BODY, NOW - TOLERANCE_S)
    upper = {k.title(): v for k, v in _headers().items()}  # Webhook-Id: names in any case
    verify([a], upper, BODY, NOW)
    good = _headers()["webhook-signature"]
    # unknown versions, junk and extra spaces around a good one
    mixed = f"v1a,hnO3f9T8Ytu9HwrXslvumlUpqtNVqkhqw== v1,AAAA  junk {good} v2,{good[3:]}"
    verify([a], _headers(**{"webhook-signature": mixed}), BODY, NOW)
    with pytest.raises(WebhookSignatureError, match="any of the 1 keys"):
        verify([parse_secret(SECRET_B, "f")], _headers(), BODY, NOW)


# --- secrets -------------------------------------------------------------------------------


def _b64(n: int) -> str:
    return base64.b64encode(bytes(range(n))).decode()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "the value is empty"),
        ("   \n", "the value is empty"),
        ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "it does not start with 'whsec_'"),
        ("whsk_" + _b64(32), "it does not start with 'whsec_'"),
        ("whsec_" + "!" * 32, "its 32 characters after 'whsec_' are not standard base64"),
        ("whsec_" + _b64(32).replace("A", "-"), "are not standard base64"),
        ("whsec_" + _b64(32) + "x", "are not standard base64"),  # 45 characters: torn
        ("whsec_" + _b64(16), "it decodes to 16 bytes; use 24 to 64"),
        ("whsec_" + _b64(65), "it decodes to 65 bytes; use 24 to 64"),
    ],
)
def test_secrets_refused_without_showing_them(text: str, why: str) -> None:
    with pytest.raises(WebhookSecretError, match=why) as caught:
        parse_secret(text, "/etc/llmd-supervisor/ci.whsec", 3)
    message = str(caught.value)
    assert message.startswith("Webhook secret in /etc/llmd-supervisor/ci.whsec line 3 is not")
    assert message.endswith("; the secret itself is not shown.")
    secret_part = text.strip().removeprefix("whsec_")
    if len(secret_part) >= 8:
        assert secret_part[:8] not in message


def test_secrets_accepted() -> None:
    assert parse_secret(SECRET_A, "f").key == KEY_A
    assert parse_secret(f"  {SECRET_A}\n", "f").key == KEY_A
    unpadded = "whsec_" + _b64(25).rstrip("=")  # 25 bytes: two '=' of padding left off
    assert parse_secret(unpadded, "f").key == bytes(range(25))
    assert parse_secret("whsec_" + _b64(64), "f").key == bytes(range(64))
    key = parse_secret(SECRET_A, "f")
    assert repr(key) == "SigningKey()"  # the key is never shown
    with pytest.raises(ValueError, match="24 to 64 bytes"):
        SigningKey(b"short")


def test_secret_file_with_rotation() -> None:
    text = (
        f"# rotated 2025-06-01\n{SECRET_B}\n\n"
        f"   # the old one, until the receiver switches\n{SECRET_A}\n"
    )
    assert [k.key for k in parse_secret_file(text, "f")] == [KEY_B, KEY_A]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "Webhook secret in f is not usable: the file holds no secret"),
        ("# only a comment\n\n", "the file holds no secret"),
        (
            f"{SECRET_A}\n{SECRET_B}\n{SECRET_A}\n",
            "f line 3 is not usable: it repeats the key of line 1",
        ),
        (f"{SECRET_A}\nnot-a-secret\n", "f line 2 is not usable: it does not start with"),
        (
            "\n".join("whsec_" + base64.b64encode(bytes([i]) * 32).decode() for i in range(9)),
            f"it holds 9 secrets; at most {KEYS_MAX} sign at once",
        ),
    ],
)
def test_secret_files_refused(text: str, why: str) -> None:
    with pytest.raises(WebhookSecretError, match=why):
        parse_secret_file(text, "f")


def test_unix_seconds() -> None:
    at = datetime(2021, 2, 25, 15, 2, 10, 999_999, tzinfo=UTC)
    assert unix_seconds(at) == 1614265330  # floored, as the reference library does
    assert unix_seconds(at.astimezone(timezone(timedelta(hours=-5)))) == 1614265330
    with pytest.raises(ValueError, match="no time zone"):
        unix_seconds(datetime(2021, 2, 25))
