"""The retry policy of outbound deliveries (`core.events.delivery`): every kind of answer, the
schedule with its jitter, the last attempt, and Retry-After in each of its forms."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest

from llmd_supervisor.core.events.delivery import (
    ATTEMPTS,
    RETRY_AFTER_MAX_S,
    SCHEDULE_S,
    TIMEOUT_S,
    Decision,
    DeliveryState,
    HttpResponse,
    NetworkFailure,
    Result,
    SendmailExit,
    Step,
    next_step,
    parse_retry_after,
    state_after,
)

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)  # a Sunday


def mid() -> float:
    return 0.5  # jitter factor exactly 1


def _retry(seconds: float, reason: str) -> Decision:
    return Decision(Step.RETRY, NOW + timedelta(seconds=seconds), reason)


def test_the_schedule_and_timeout_are_the_issue_s() -> None:
    assert SCHEDULE_S == (0, 5, 30, 120, 600, 1800, 3600, 7200, 21600, 43200, 86400)
    assert ATTEMPTS == 11
    assert TIMEOUT_S == 15.0
    assert sum(SCHEDULE_S) == 164_555  # about 46 hours from the first attempt to the last


@pytest.mark.parametrize(
    ("attempt", "result", "decision"),
    [
        # 2xx: delivered, whatever the attempt
        (1, HttpResponse(200), Decision(Step.DONE, None, "HTTP 200")),
        (1, HttpResponse(204), Decision(Step.DONE, None, "HTTP 204")),
        (11, HttpResponse(299), Decision(Step.DONE, None, "HTTP 299")),
        # 410: dead, and the destination disabled
        (
            1,
            HttpResponse(410),
            Decision(Step.DISABLE, None, "HTTP 410 Gone: the receiver wants no more events"),
        ),
        # other 4xx but 408 and 429: final
        (
            1,
            HttpResponse(400),
            Decision(Step.DEAD, None, "HTTP 400: the receiver refused the event"),
        ),
        (
            3,
            HttpResponse(401),
            Decision(Step.DEAD, None, "HTTP 401: the receiver refused the event"),
        ),
        (
            1,
            HttpResponse(403),
            Decision(Step.DEAD, None, "HTTP 403: the receiver refused the event"),
        ),
        (
            1,
            HttpResponse(404),
            Decision(Step.DEAD, None, "HTTP 404: the receiver refused the event"),
        ),
        (
            1,
            HttpResponse(413),
            Decision(Step.DEAD, None, "HTTP 413: the receiver refused the event"),
        ),
        (
            1,
            HttpResponse(499),
            Decision(Step.DEAD, None, "HTTP 499: the receiver refused the event"),
        ),
        # 408 and 429 are retried
        (1, HttpResponse(408), _retry(5, "attempt 1: HTTP 408")),
        (2, HttpResponse(429), _retry(30, "attempt 2: HTTP 429")),
        # 5xx is retried
        (3, HttpResponse(500), _retry(120, "attempt 3: HTTP 500")),
        (4, HttpResponse(502), _retry(600, "attempt 4: HTTP 502")),
        (5, HttpResponse(503), _retry(1800, "attempt 5: HTTP 503")),
        (6, HttpResponse(504), _retry(3600, "attempt 6: HTTP 504")),
        # 3xx: a failure (redirects are never followed), retried
        (
            1,
            HttpResponse(301),
            _retry(
                5, "attempt 1: HTTP 301 (a redirect, not followed: update the destination's url)"
            ),
        ),
        (
            7,
            HttpResponse(308, retry_after="60"),
            _retry(
                7200,
                "attempt 7: HTTP 308 (a redirect, not followed: update the destination's url)",
            ),
        ),
        # a status no receiver answers with: a failure, retried
        (
            1,
            HttpResponse(101),
            _retry(5, "attempt 1: HTTP 101 (not a status a receiver answers with)"),
        ),
        (
            1,
            HttpResponse(600),
            _retry(5, "attempt 1: HTTP 600 (not a status a receiver answers with)"),
        ),
        # no answer
        (
            8,
            NetworkFailure("timed out after 15 s"),
            _retry(21600, "attempt 8: timed out after 15 s"),
        ),
        (9, NetworkFailure("connection refused"), _retry(43200, "attempt 9: connection refused")),
        (
            1,
            NetworkFailure("reset\x1b[2J"),
            _retry(5, "attempt 1: reset\\x1b[2J"),  # an error's text is escaped too
        ),
        # the last attempt: a retry becomes dead
        (10, HttpResponse(503), _retry(86400, "attempt 10: HTTP 503")),
        (
            11,
            HttpResponse(503),
            Decision(Step.DEAD, None, "gave up after 11 attempts; the last: HTTP 503"),
        ),
        (
            11,
            NetworkFailure("timed out after 15 s"),
            Decision(Step.DEAD, None, "gave up after 11 attempts; the last: timed out after 15 s"),
        ),
        (
            12,
            HttpResponse(429),
            Decision(Step.DEAD, None, "gave up after 12 attempts; the last: HTTP 429"),
        ),
        # mail through sendmail
        (1, SendmailExit(0), Decision(Step.DONE, None, "sendmail took the message")),
        (1, SendmailExit(75), _retry(5, "attempt 1: sendmail exited 75")),
        (1, SendmailExit(69), _retry(5, "attempt 1: sendmail exited 69")),
        (
            1,
            SendmailExit(None),
            _retry(5, "attempt 1: sendmail could not be started or was killed"),
        ),
        (
            1,
            SendmailExit(67),
            Decision(Step.DEAD, None, "sendmail exited 67 (EX_NOUSER): retrying cannot help"),
        ),
        (
            1,
            SendmailExit(64),
            Decision(Step.DEAD, None, "sendmail exited 64 (EX_USAGE): retrying cannot help"),
        ),
        (
            1,
            SendmailExit(65),
            Decision(Step.DEAD, None, "sendmail exited 65 (EX_DATAERR): retrying cannot help"),
        ),
        (
            1,
            SendmailExit(68),
            Decision(Step.DEAD, None, "sendmail exited 68 (EX_NOHOST): retrying cannot help"),
        ),
        (
            11,
            SendmailExit(75),
            Decision(Step.DEAD, None, "gave up after 11 attempts; the last: sendmail exited 75"),
        ),
    ],
)
def test_next_step(attempt: int, result: Result, decision: Decision) -> None:
    assert next_step(attempt, result, NOW, mid) == decision


def test_attempts_are_counted_from_one() -> None:
    with pytest.raises(ValueError, match="attempt 0 is not a number of attempts made"):
        next_step(0, HttpResponse(500), NOW, mid)


@pytest.mark.parametrize(
    ("rng", "seconds"),
    [
        (lambda: 0.0, 27.0),  # factor 0.9
        (lambda: 0.25, 28.5),
        (lambda: 0.5, 30.0),
        (lambda: 0.75, 31.5),
        (lambda: 1.0, 33.0),  # factor 1.1
        (lambda: 7.0, 33.0),  # a source out of [0, 1) is clamped
        (lambda: -1.0, 27.0),
    ],
)
def test_jitter_comes_from_the_injected_source(rng: Callable[[], float], seconds: float) -> None:
    decision = next_step(2, HttpResponse(500), NOW, rng)
    assert decision.at == NOW + timedelta(seconds=seconds)


def test_a_whole_series_of_failures() -> None:
    at = NOW
    times = [at]
    attempt = 1
    while True:
        d = next_step(attempt, HttpResponse(503), at, mid)
        if d.step is not Step.RETRY:
            break
        assert d.at is not None
        at = d.at
        times.append(at)
        attempt += 1
    assert d == Decision(Step.DEAD, None, "gave up after 11 attempts; the last: HTTP 503")
    assert len(times) == ATTEMPTS
    gaps = [int((b - a).total_seconds()) for a, b in pairwise(times)]
    assert gaps == list(SCHEDULE_S[1:])
    assert times[-1] - times[0] == timedelta(seconds=164_555)


# --- Retry-After ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "status", "header", "seconds", "reason"),
    [
        # longer than the schedule: honoured
        (1, 429, "120", 120, "attempt 1: HTTP 429 (Retry-After honoured: 120 s)"),
        (
            1,
            503,
            "Sun, 01 Jun 2025 12:10:00 GMT",
            600,
            "attempt 1: HTTP 503 (Retry-After honoured: 600 s)",
        ),
        # shorter than the schedule: the schedule (never earlier)
        (5, 429, "1", 1800, "attempt 5: HTTP 429"),
        (1, 429, "0", 5, "attempt 1: HTTP 429"),
        (1, 429, "Sun, 01 Jun 2025 11:00:00 GMT", 5, "attempt 1: HTTP 429"),  # in the past
        # bounded: a receiver cannot park a delivery for more than a day
        (1, 429, "999999", 86400, "attempt 1: HTTP 429 (Retry-After honoured: 86400 s)"),
        (
            1,
            503,
            "Mon, 01 Jun 2026 12:00:00 GMT",
            86400,
            "attempt 1: HTTP 503 (Retry-After honoured: 86400 s)",
        ),
        # not a delay: ignored, and said
        (1, 429, "soon", 5, "attempt 1: HTTP 429 (Retry-After 'soon' ignored: not a delay)"),
        (1, 429, "-5", 5, "attempt 1: HTTP 429 (Retry-After '-5' ignored: not a delay)"),
        # a 408 or 5xx with one is honoured the same way
        (2, 408, "45", 45, "attempt 2: HTTP 408 (Retry-After honoured: 45 s)"),
    ],
)
def test_retry_after_is_honoured_and_bounded(
    attempt: int, status: int, header: str, seconds: float, reason: str
) -> None:
    assert next_step(attempt, HttpResponse(status, header), NOW, mid) == _retry(seconds, reason)


def test_retry_after_does_not_keep_a_finished_delivery_alive() -> None:
    assert next_step(1, HttpResponse(200, "120"), NOW, mid).step is Step.DONE
    assert next_step(1, HttpResponse(404, "120"), NOW, mid).step is Step.DEAD
    assert next_step(11, HttpResponse(429, "120"), NOW, mid).step is Step.DEAD


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("120", 120.0),
        (" 120 ", 120.0),
        ("0", 0.0),
        ("86400", 86400.0),
        ("86401", float(RETRY_AFTER_MAX_S)),
        ("99999999999999999999", float(RETRY_AFTER_MAX_S)),
        ("-5", None),
        ("1.5", None),
        ("", None),
        ("120s", None),
        # IMF-fixdate, RFC 850 and asctime (RFC 9110 section 5.6.7)
        ("Sun, 01 Jun 2025 12:02:00 GMT", 120.0),
        ("Sunday, 01-Jun-25 12:02:00 GMT", 120.0),
        ("Sun Jun  1 12:02:00 2025", 120.0),
        ("Sun Jun 11 12:00:00 2025", 86400.0),  # 10 days ahead: capped
        ("Sun, 01 Jun 2025 11:59:59 GMT", 0.0),  # in the past
        # RFC 850's two-digit year: more than 50 years ahead is the century before
        ("Sunday, 01-Jun-74 12:00:00 GMT", 86400.0),  # 2074: ahead (capped)
        ("Sunday, 01-Jun-76 12:00:00 GMT", 0.0),  # 1976, not 2076
        # not HTTP-dates
        ("Sun, 01 Jun 2025 12:02:00 +0000", None),  # only GMT
        ("sun, 01 jun 2025 12:02:00 GMT", None),  # names are case-sensitive
        ("Sun, 31 Feb 2025 12:00:00 GMT", None),
        ("Sun, 01 Foo 2025 12:00:00 GMT", None),
        ("Sun, 01 Jun 2025 25:00:00 GMT", None),
        ("2025-06-01T12:02:00Z", None),
    ],
)
def test_parse_retry_after(value: str, seconds: float | None) -> None:
    assert parse_retry_after(value, NOW) == seconds


def test_rfc850_years_near_a_century_end() -> None:
    late = datetime(2099, 6, 1, tzinfo=UTC)
    # "01" in 2099 is 2101 (2 years ahead), not 2001 (98 years ago)
    assert parse_retry_after("Wednesday, 01-Jun-01 00:00:00 GMT", late) == 86400.0
    assert parse_retry_after("Monday, 01-Jun-98 00:00:00 GMT", late) == 0.0  # 2098


def test_delivery_states() -> None:
    assert [
        state_after(next_step(1, r, NOW, mid))
        for r in (
            HttpResponse(200),
            HttpResponse(500),
            HttpResponse(404),
            HttpResponse(410),
        )
    ] == [DeliveryState.DELIVERED, DeliveryState.RETRYING, DeliveryState.DEAD, DeliveryState.DEAD]
