"""Standard Webhooks 1.0 signatures (pure): what a webhook delivery carries, and the check
a receiver makes (tests/data/standard-webhooks/SOURCE.md says what of the spec this
relies on).

- A destination's secret is ``whsec_`` followed by the base64 of 24 to 64 random bytes;
  the HMAC key is the decoded bytes (`parse_secret`). Its ``secret_file`` holds one
  secret per line (blank lines and ``#`` comments aside): all of them sign every
  delivery, which is how a key is rotated without a gap (`parse_secret_file`): add the new
  line, let the receiver switch, remove the old one.
- Every delivery of an event has the headers ``webhook-id`` (the event id: the same on
  every retry, the receiver's dedupe key), ``webhook-timestamp`` (integer Unix seconds of
  this attempt, not of the event) and ``webhook-signature``: ``v1,`` and the base64 of
  HMAC-SHA256 over ``{id}.{timestamp}.{body}``, one per key, separated by spaces
  (`webhook_headers`).
- `verify` is the receiver's side (our tests, a site's receiver written after it): the
  timestamp within `TOLERANCE_S` of now either way, then any ``v1`` signature equal, in
  constant time, to one computed with any of the keys; other versions (``v1a``) are
  ignored.

Errors name the file, the line and what is wrong, never a secret's characters
(`WebhookSecretError`); a failed check is a `WebhookSignatureError`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from llmd_supervisor.core.run.jobtext import job_repr
from llmd_supervisor.errors import WebhookSecretError, WebhookSignatureError

__all__ = [
    "KEYS_MAX",
    "KEY_MAX_BYTES",
    "KEY_MIN_BYTES",
    "SECRET_PREFIX",
    "TOLERANCE_S",
    "SigningKey",
    "parse_secret",
    "parse_secret_file",
    "sign",
    "signed_content",
    "unix_seconds",
    "verify",
    "webhook_headers",
]

SECRET_PREFIX: Final = "whsec_"
# The spec: a symmetric secret is random, at least 24 bytes (192 bits), at most 512 bits.
KEY_MIN_BYTES: Final = 24
KEY_MAX_BYTES: Final = 64
KEYS_MAX: Final = 8  # lines of one secret file: the current key and the ones it replaces
# The reference libraries refuse a timestamp more than 5 minutes from now, either way.
TOLERANCE_S: Final = 300
VERSION: Final = "v1"  # symmetric HMAC-SHA256
_MSG_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,256}")
_TIMESTAMP: Final = re.compile(r"[0-9]{1,12}")
_B64: Final = re.compile(r"[A-Za-z0-9+/]*={0,2}")


@dataclass(frozen=True)
class SigningKey:
    """One HMAC key (the decoded part of a ``whsec_`` secret); never shown by repr."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not KEY_MIN_BYTES <= len(self.key) <= KEY_MAX_BYTES:
            raise ValueError(f"a key has {KEY_MIN_BYTES} to {KEY_MAX_BYTES} bytes")


def parse_secret(text: str, source: str, line: int | None = None) -> SigningKey:
    """The key of one ``whsec_`` secret (`source`, `line`: where it was read, for the
    message). WebhookSecretError naming what is wrong, never the secret."""
    value = text.strip()
    if not value:
        raise WebhookSecretError(source, line, "the value is empty")
    if not value.startswith(SECRET_PREFIX):
        raise WebhookSecretError(
            source,
            line,
            f"it does not start with {SECRET_PREFIX!r} (a Standard Webhooks secret is "
            f"{SECRET_PREFIX} and the base64 of {KEY_MIN_BYTES} to {KEY_MAX_BYTES} random "
            "bytes, e.g. from `printf 'whsec_%s\\n' \"$(head -c 32 /dev/urandom | base64)\"`)",
        )
    encoded = value[len(SECRET_PREFIX) :]
    padded = encoded + "=" * (-len(encoded) % 4)  # unpadded base64 is accepted too
    try:
        if not _B64.fullmatch(padded):
            raise ValueError("not base64")
        key = base64.b64decode(padded, validate=True)
    except (ValueError, binascii.Error):
        raise WebhookSecretError(
            source,
            line,
            f"its {len(encoded)} characters after {SECRET_PREFIX!r} are not standard base64 "
            "(A-Z, a-z, 0-9, + and /, padded with =)",
        ) from None
    if not KEY_MIN_BYTES <= len(key) <= KEY_MAX_BYTES:
        raise WebhookSecretError(
            source,
            line,
            f"it decodes to {len(key)} bytes; use {KEY_MIN_BYTES} to {KEY_MAX_BYTES} random "
            "bytes (32 is usual)",
        )
    return SigningKey(key)


def parse_secret_file(text: str, source: str) -> tuple[SigningKey, ...]:
    """Every key of a ``secret_file``'s text, in file order (the first is the newest by
    convention; all of them sign). Blank lines and lines starting with ``#`` are skipped."""
    keys: list[SigningKey] = []
    seen: dict[bytes, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key = parse_secret(stripped, source, number)
        if key.key in seen:
            raise WebhookSecretError(
                source, number, f"it repeats the key of line {seen[key.key]}; remove one"
            )
        seen[key.key] = number
        keys.append(key)
    if not keys:
        raise WebhookSecretError(
            source, None, f"the file holds no secret (one {SECRET_PREFIX}... line is needed)"
        )
    if len(keys) > KEYS_MAX:
        raise WebhookSecretError(
            source,
            None,
            f"it holds {len(keys)} secrets; at most {KEYS_MAX} sign at once (remove the "
            "ones the receiver no longer accepts)",
        )
    return tuple(keys)


def unix_seconds(at: datetime) -> int:
    """`at` (time-zone aware) as the integer Unix seconds of ``webhook-timestamp``."""
    if at.tzinfo is None:
        raise ValueError(f"{at!r} has no time zone")
    return int(at.timestamp() // 1)


def signed_content(msg_id: str, timestamp: int, body: bytes) -> bytes:
    """What is signed: ``{msg_id}.{timestamp}.{body}``. ValueError for an id that is not
    1-256 of ``[A-Za-z0-9_-]`` (a ``.`` in it would make the content ambiguous) or a
    timestamp that is not a non-negative integer."""
    if not _MSG_ID.fullmatch(msg_id):
        raise ValueError(f"webhook id {job_repr(msg_id)} is not 1-256 of [A-Za-z0-9_-]")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int) or timestamp < 0:
        raise ValueError(f"webhook timestamp {timestamp!r} is not a non-negative integer")
    return f"{msg_id}.{timestamp}.".encode("ascii") + body


def _signature(key: SigningKey, content: bytes) -> bytes:
    return hmac.new(key.key, content, hashlib.sha256).digest()


def sign(keys: Sequence[SigningKey], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: one ``v1,<base64>`` per key, space-separated."""
    if not keys:
        raise ValueError("signing needs at least one key")
    content = signed_content(msg_id, timestamp, body)
    return " ".join(
        f"{VERSION},{base64.b64encode(_signature(k, content)).decode('ascii')}" for k in keys
    )


def webhook_headers(
    keys: Sequence[SigningKey], msg_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """The three Standard Webhooks headers of one delivery attempt of `body`."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(keys, msg_id, timestamp, body),
    }


def verify(
    keys: Sequence[SigningKey],
    headers: Mapping[str, str],
    body: bytes,
    now: int,
    tolerance_s: int = TOLERANCE_S,
) -> None:
    """Check a received request (header names in any case); WebhookSignatureError says
    why it does not verify. `now` is the receiver's Unix time in seconds."""
    lower = {k.lower(): v for k, v in headers.items()}
    values = {}
    for name in ("webhook-id", "webhook-timestamp", "webhook-signature"):
        value = lower.get(name)
        if not value:
            raise WebhookSignatureError(f"the {name} header is missing or empty")
        values[name] = value
    msg_id = values["webhook-id"]
    stamp = values["webhook-timestamp"]
    if not _TIMESTAMP.fullmatch(stamp):
        raise WebhookSignatureError(
            f"webhook-timestamp {job_repr(stamp)} is not an integer number of seconds"
        )
    timestamp = int(stamp)
    if timestamp < now - tolerance_s:
        raise WebhookSignatureError(
            f"webhook-timestamp {timestamp} is {now - timestamp} s old; at most "
            f"{tolerance_s} s is accepted (a replay, or the sender's clock is behind)"
        )
    if timestamp > now + tolerance_s:
        raise WebhookSignatureError(
            f"webhook-timestamp {timestamp} is {timestamp - now} s ahead of this clock; at "
            f"most {tolerance_s} s is accepted"
        )
    try:
        content = signed_content(msg_id, timestamp, body)
    except ValueError:
        raise WebhookSignatureError(
            f"webhook-id {job_repr(msg_id)} is not 1-256 of [A-Za-z0-9_-]"
        ) from None
    expected = [_signature(k, content) for k in keys]
    for item in values["webhook-signature"].split(" "):
        version, _, encoded = item.partition(",")
        if version != VERSION or not _B64.fullmatch(encoded):
            continue
        try:
            got = base64.b64decode(encoded, validate=True)
        except (ValueError, binascii.Error):
            continue
        # Every key is compared, with no early exit on the one that matched.
        matches = [hmac.compare_digest(got, e) for e in expected]
        if True in matches:
            return
    raise WebhookSignatureError(
        f"no {VERSION} signature in webhook-signature matches any of the {len(keys)} keys"
    )
