"""When to deliver an event to a destination again, as data (pure).

One delivery (an event to one destination) is attempted at most `ATTEMPTS` times: the
first at once, each next one `SCHEDULE_S` later (5 s, 30 s, 2 min, 10 min, 30 min, 1 h,
2 h, 6 h, 12 h, 24 h: about 46 hours from first to last), each delay scaled by a
factor in [1 - `JITTER`, 1 + `JITTER`) drawn from an injected random source, so that
deliveries that failed together do not return together. Each attempt has `TIMEOUT_S`.

`next_step(attempt, result, now, rng)` decides from what the attempt got:

=================================  ===========================================
result                             step
=================================  ===========================================
HTTP 2xx                           DONE
HTTP 410 Gone                      DISABLE: this delivery is dead and the
                                   destination takes nothing more until an
                                   operator enables it again
HTTP 4xx other than 408 and 429    DEAD at once (the receiver refused it;
                                   sending it again will not change that)
HTTP 408, 429, 5xx                 RETRY
HTTP 3xx                           RETRY (redirects are never followed: a
                                   moved receiver is a config change)
any other status                   RETRY
a network error or the timeout     RETRY
sendmail exit 0                    DONE
sendmail exit 64, 65, 67, 68       DEAD (usage, data, no such user or host)
any other sendmail end             RETRY (75 is sendmail's "try again later")
=================================  ===========================================

A RETRY after the last attempt is DEAD instead. A dead delivery stays in the journal and
can be replayed by hand (a replay starts a new series of attempts). A ``Retry-After`` of
a retried HTTP answer (delay-seconds or an HTTP-date, RFC 9110 §10.2.3) moves the next
attempt later, never earlier, and by at most `RETRY_AFTER_MAX_S`; one that cannot be
parsed is ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Final

from llmd_supervisor.core.run.jobtext import job_repr, job_text

__all__ = [
    "ATTEMPTS",
    "JITTER",
    "RETRY_AFTER_MAX_S",
    "SCHEDULE_S",
    "TIMEOUT_S",
    "Decision",
    "DeliveryState",
    "HttpResponse",
    "NetworkFailure",
    "Result",
    "SendmailExit",
    "Step",
    "next_step",
    "parse_retry_after",
    "state_after",
]

# Seconds before attempt n+1 (index n): the first attempt is immediate.
SCHEDULE_S: Final = (0, 5, 30, 120, 600, 1800, 3600, 7200, 21600, 43200, 86400)
ATTEMPTS: Final = len(SCHEDULE_S)
TIMEOUT_S: Final = 15.0  # one attempt: connect, send, and the receiver's answer
JITTER: Final = 0.1
RETRY_AFTER_MAX_S: Final = 86400  # a receiver cannot park a delivery for longer than a day

# sysexits.h codes after which sending the same message again cannot succeed.
_SENDMAIL_FINAL: Final = {
    64: "EX_USAGE",
    65: "EX_DATAERR",
    67: "EX_NOUSER",
    68: "EX_NOHOST",
}


class Step(StrEnum):
    """What to do with a delivery after an attempt."""

    DONE = "done"  # delivered (a 2xx, or sendmail took it)
    RETRY = "retry"  # attempt again at Decision.at
    DEAD = "dead"  # no more attempts; kept, and replayable by hand
    DISABLE = "disable"  # 410 Gone: dead, and the destination is disabled


class DeliveryState(StrEnum):
    """A delivery's state in the journal (metrics count them per destination)."""

    PENDING = "pending"  # not attempted yet
    RETRYING = "retrying"  # attempted, failed, another attempt is due
    DELIVERED = "delivered"
    DEAD = "dead"


@dataclass(frozen=True)
class HttpResponse:
    """The receiver answered (webhook, Slack): its status and its Retry-After, if any."""

    status: int
    retry_after: str | None = None


@dataclass(frozen=True)
class NetworkFailure:
    """No answer: connection refused or reset, DNS, TLS, or the timeout."""

    what: str  # one phrase, e.g. "timed out after 15 s", "connection refused"


@dataclass(frozen=True)
class SendmailExit:
    """How the local ``sendmail -t -oi`` ended (None: it could not be started or was
    killed by a signal)."""

    status: int | None


Result = HttpResponse | NetworkFailure | SendmailExit


@dataclass(frozen=True)
class Decision:
    """The step after an attempt, when (RETRY only), and why (one phrase)."""

    step: Step
    at: datetime | None
    reason: str


def state_after(decision: Decision) -> DeliveryState:
    """The delivery's journal state once `decision` is applied."""
    return {
        Step.DONE: DeliveryState.DELIVERED,
        Step.RETRY: DeliveryState.RETRYING,
        Step.DEAD: DeliveryState.DEAD,
        Step.DISABLE: DeliveryState.DEAD,
    }[decision.step]


def next_step(attempt: int, result: Result, now: datetime, rng: Callable[[], float]) -> Decision:
    """The decision after attempt number `attempt` (1 for the first) ended with `result`
    at `now`; `rng()` gives the jitter (a float in [0, 1), like `random.random`)."""
    if attempt < 1:
        raise ValueError(f"attempt {attempt} is not a number of attempts made (1 or more)")
    step, why, retry_after = _classify(result, now)
    if step is not Step.RETRY:
        return Decision(step=step, at=None, reason=why)
    if attempt >= ATTEMPTS:
        return Decision(
            step=Step.DEAD, at=None, reason=f"gave up after {attempt} attempts; the last: {why}"
        )
    r = min(max(rng(), 0.0), 1.0)
    delay = SCHEDULE_S[attempt] * (1 - JITTER + 2 * JITTER * r)
    if retry_after is not None and retry_after > delay:
        delay = float(retry_after)
        why += f" (Retry-After honoured: {retry_after:g} s)"
    return Decision(
        step=Step.RETRY, at=now + timedelta(seconds=delay), reason=f"attempt {attempt}: {why}"
    )


def _classify(result: Result, now: datetime) -> tuple[Step, str, float | None]:
    """(step before the schedule is considered, why, Retry-After seconds or None)."""
    if isinstance(result, NetworkFailure):
        return Step.RETRY, job_text(result.what, 200), None
    if isinstance(result, SendmailExit):
        status = result.status
        if status == 0:
            return Step.DONE, "sendmail took the message", None
        if status is None:
            return Step.RETRY, "sendmail could not be started or was killed", None
        if status in _SENDMAIL_FINAL:
            name = _SENDMAIL_FINAL[status]
            return Step.DEAD, f"sendmail exited {status} ({name}): retrying cannot help", None
        return Step.RETRY, f"sendmail exited {status}", None
    status = result.status
    if 200 <= status <= 299:
        return Step.DONE, f"HTTP {status}", None
    if status == 410:
        return Step.DISABLE, "HTTP 410 Gone: the receiver wants no more events", None
    if 400 <= status <= 499 and status not in (408, 429):
        return Step.DEAD, f"HTTP {status}: the receiver refused the event", None
    why = f"HTTP {status}"
    if 300 <= status <= 399:
        why += " (a redirect, not followed: update the destination's url)"
    elif not 400 <= status <= 599:
        why += " (not a status a receiver answers with)"
    retry_after = None
    if result.retry_after is not None:
        retry_after = parse_retry_after(result.retry_after, now)
        if retry_after is None:
            why += f" (Retry-After {job_repr(result.retry_after, 60)} ignored: not a delay)"
    return Step.RETRY, why, retry_after


_IMF: Final = re.compile(
    r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d{2}) ([A-Z][a-z]{2}) (\d{4}) "
    r"(\d{2}):(\d{2}):(\d{2}) GMT"
)
_RFC850: Final = re.compile(
    r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), "
    r"(\d{2})-([A-Z][a-z]{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2}) GMT"
)
_ASCTIME: Final = re.compile(
    r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ([A-Z][a-z]{2}) ([ \d]\d) "
    r"(\d{2}):(\d{2}):(\d{2}) (\d{4})"
)
_MONTHS: Final = {
    m: i
    for i, m in enumerate(
        ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1
    )
}


def parse_retry_after(value: str, now: datetime) -> float | None:
    """Seconds from `now` a Retry-After asks to wait, within [0, RETRY_AFTER_MAX_S]
    (a date in the past: 0); None when it is neither delay-seconds nor an HTTP-date.

    The three HTTP-date forms a recipient must accept (RFC 9110 §5.6.7): IMF-fixdate
    ``Sun, 06 Nov 1994 08:49:37 GMT``, the obsolete RFC 850 ``Sunday, 06-Nov-94
    08:49:37 GMT`` (a two-digit year more than 50 years ahead is the century before)
    and asctime ``Sun Nov  6 08:49:37 1994``. Names are matched in English, never by
    the locale.
    """
    text = value.strip()
    if re.fullmatch(r"\d{1,20}", text):
        return float(min(int(text), RETRY_AFTER_MAX_S))
    when = _http_date(text, now)
    if when is None:
        return None
    seconds = (when - now).total_seconds()
    return min(max(seconds, 0.0), float(RETRY_AFTER_MAX_S))


def _http_date(text: str, now: datetime) -> datetime | None:
    if m := _IMF.fullmatch(text):
        day, month, year, hh, mm, ss = m.groups()
        return _date(int(year), month, int(day), hh, mm, ss)
    if m := _RFC850.fullmatch(text):
        day, month, yy, hh, mm, ss = m.groups()
        this_year = now.astimezone(UTC).year
        year = this_year // 100 * 100 + int(yy)
        if year > this_year + 50:  # more than 50 years ahead: the century before
            year -= 100
        elif year < this_year - 50:  # the next century's is at most 50 years ahead
            year += 100
        return _date(year, month, int(day), hh, mm, ss)
    if m := _ASCTIME.fullmatch(text):
        month, day, hh, mm, ss, year = m.groups()
        return _date(int(year), month, int(day.strip()), hh, mm, ss)
    return None


def _date(year: int, month: str, day: int, hh: str, mm: str, ss: str) -> datetime | None:
    if month not in _MONTHS:
        return None
    try:
        return datetime(year, _MONTHS[month], day, int(hh), int(mm), int(ss), tzinfo=UTC)
    except ValueError:  # 31 Feb, 25:00:00
        return None
