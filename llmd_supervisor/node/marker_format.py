"""The one reader of the completion marker's bytes; stdlib only, Python 3.9+.

The node agent (deciding its exit status) and the daemon (`core.verdict.marker`, the verdict) both
read ``.bench_done.<jobid>`` through `parse`, so the two can never disagree about what a
marker says. The coordinator writes JSON ``{"rc": int, "job_id": str, "rank": int,
"reason": str, "finished_at": iso8601}`` (write to a temp file, fsync, rename).
InferenceX's launcher writes the rc alone as a plain integer and a newline (``7\\n``):
format ``int`` (no rank, no reason); digits without the newline are a torn write.

The rules (DESIGN.md section 4):
  * ``rc`` is an exit status: a JSON integer from 0 to 255, never a boolean (``exit(256)``
    and ``exit(False)`` both exit 0, so any other value would pass a failure off as a
    success) -- see `marker_rc`;
  * ``job_id`` is the string of the job being read for; ``rank`` an integer >= 0;
    ``reason`` a string; ``finished_at`` an ISO 8601 timestamp (`parse_timestamp`: read
    alike by every Python from 3.9 on);
  * every other defect is its own status (the names of ``core.verdict.marker.MarkerStatus``).

`parse` never raises. The values a detail quotes were written by the job: the caller
passes `shown` to make them safe for where the detail goes (the daemon escapes them).
"""

import datetime
import json
import re
from typing import Any, Callable, Optional

FIELDS = ("rc", "job_id", "rank", "reason", "finished_at")

# Statuses (``core.verdict.marker.MarkerStatus`` has one member per value).
MISSING = "missing"  # no file (not written yet, or shared-filesystem lag)
EMPTY = "empty"  # zero bytes or only whitespace
TRUNCATED = "truncated"  # a JSON object or a plain integer cut short
NOT_JSON = "not_json"  # not UTF-8 JSON at all
NOT_OBJECT = "not_object"  # valid JSON, but not an object
MISSING_FIELDS = "missing_fields"  # one or more of FIELDS absent
WRONG_JOB_ID = "wrong_job_id"  # job_id is not the job being read for
RC_NOT_INTEGER = "rc_not_integer"  # rc is no exit status (see marker_rc)
BAD_FIELD = "bad_field"  # job_id/reason not a string, or rank not an int >= 0
BAD_FINISHED_AT = "bad_finished_at"  # finished_at is not an ISO 8601 timestamp
OK = "ok"
# A later read may still find a valid marker (not written or not visible yet).
MAY_STILL_ARRIVE = (MISSING, EMPTY, TRUNCATED)

NO_EXIT_STATUS = "is not an exit status (an integer from 0 to 255)"
# A plain-integer marker is complete only with its newline; digits alone may be torn.
_INT_MARKER = re.compile(r"(0|-?[1-9][0-9]{0,9})\n")
_TORN_INT = re.compile(r"-?[0-9]{1,10}")


# ISO 8601 as every Python from 3.9 on reads it alike: ``datetime.fromisoformat`` takes
# more forms on 3.11 (the daemon) than on 3.9 (a node's image), so a timestamp is first
# matched here and put into the one form both take (fraction of 6 digits, ``Z`` as +00:00).
_TIMESTAMP = re.compile(
    r"([0-9]{4}-[0-9]{2}-[0-9]{2})"
    r"(?:[T ]([0-9]{2}:[0-9]{2})(?::([0-9]{2})(?:\.([0-9]{1,6}))?)?(Z|[+-][0-9]{2}:[0-9]{2})?)?"
)


def parse_timestamp(text: str) -> Optional[datetime.datetime]:
    """`text` as a datetime when it is ISO 8601 (``2026-12-03T07:00:00.123+00:00``, with
    ``T`` or a space, seconds, fraction and offset optional, ``Z`` for UTC), else None."""
    m = _TIMESTAMP.fullmatch(text)
    if m is None:
        return None
    date, hours_minutes, seconds, fraction, zone = m.groups()
    form = date
    if hours_minutes is not None:
        form += "T%s:%s.%s" % (hours_minutes, seconds or "00", (fraction or "").ljust(6, "0"))
        form += "+00:00" if zone == "Z" else (zone or "")
    try:
        return datetime.datetime.fromisoformat(form)
    except ValueError:  # a month 13, a 25th hour
        return None


def marker_rc(value: object) -> Optional[int]:
    """A marker's ``rc`` as the exit status it stands for: an ``int`` (a ``bool`` is not
    one) from 0 to 255, else None."""
    if type(value) is not int or not 0 <= value <= 255:
        return None
    return value


def shown_json(value: object, limit: int = 80) -> str:
    """A value the job wrote, as JSON text of at most `limit` characters."""
    try:
        text = json.dumps(value)
    except ValueError:  # NaN and infinities are valid to json.loads, not to dumps(strict)
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Parsed(object):
    """What one marker file turned out to be: `status` and a `detail` phrase ("" when
    OK); the fields are set only when the status is OK (``rank``, ``reason`` and
    ``finished_at`` are None in an ``int`` marker); ``rc_shown`` only with
    RC_NOT_INTEGER."""

    def __init__(
        self,
        status: str,
        detail: str = "",
        rc: Optional[int] = None,
        rank: Optional[int] = None,
        reason: Optional[str] = None,
        finished_at: Optional[datetime.datetime] = None,
        fmt: str = "json",
        rc_shown: str = "",
    ) -> None:
        self.status = status
        self.detail = detail
        self.rc = rc
        self.rank = rank
        self.reason = reason
        self.finished_at = finished_at
        self.format = fmt
        self.rc_shown = rc_shown  # an rc that is no exit status, as `shown` gave it

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def may_still_arrive(self) -> bool:
        return self.status in MAY_STILL_ARRIVE

    def __repr__(self) -> str:
        return "Parsed(%r, %r, rc=%r)" % (self.status, self.detail, self.rc)


def parse(
    data: Optional[bytes], expected_job_id: str, shown: Callable[[Any], str] = shown_json
) -> Parsed:
    """Interpret a marker file's bytes (None: no such file); never raises."""
    if data is None:
        return Parsed(MISSING, "no such file")
    decoded = data.decode("utf-8", "replace")
    body = decoded.strip()
    if not body:
        return Parsed(EMPTY, "%d bytes, no content" % len(data))
    if _INT_MARKER.fullmatch(decoded):  # InferenceX: "7\n"
        rc = marker_rc(int(decoded))
        if rc is None:
            return Parsed(RC_NOT_INTEGER, "rc %s %s" % (body, NO_EXIT_STATUS), rc_shown=body)
        return Parsed(OK, rc=rc, fmt="int")
    if _TORN_INT.fullmatch(decoded):
        return Parsed(TRUNCATED, "plain integer %r without its newline" % decoded)
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        return Parsed(NOT_JSON, "not UTF-8")
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        # The writer renames a complete file into place, so a cut-off object means a
        # non-atomic writer or a file system that shows a file before its content.
        if body.startswith("{") and not body.endswith("}"):
            return Parsed(TRUNCATED, "JSON object cut off after %d bytes" % len(data))
        return Parsed(NOT_JSON, type(exc).__name__)
    if not isinstance(value, dict):
        return Parsed(NOT_OBJECT, "JSON %s, not an object" % type(value).__name__)
    missing = [f for f in FIELDS if f not in value]
    if missing:
        return Parsed(MISSING_FIELDS, "no " + ", ".join(missing))
    job_id, rc, rank = value["job_id"], value["rc"], value["rank"]
    reason, finished = value["reason"], value["finished_at"]
    if not isinstance(job_id, str):
        return Parsed(BAD_FIELD, "job_id %s is not a string" % shown(job_id))
    if job_id != expected_job_id:
        return Parsed(WRONG_JOB_ID, "for job %s, not %r" % (shown(job_id), expected_job_id))
    if marker_rc(rc) is None:  # neither a bool (rc 0/1) nor 256 (exit status 0)
        return Parsed(RC_NOT_INTEGER, "rc %s %s" % (shown(rc), NO_EXIT_STATUS), rc_shown=shown(rc))
    if type(rank) is not int or rank < 0:
        return Parsed(BAD_FIELD, "rank %s is not an integer >= 0" % shown(rank))
    if not isinstance(reason, str):
        return Parsed(BAD_FIELD, "reason %s is not a string" % shown(reason))
    if not isinstance(finished, str):
        return Parsed(BAD_FINISHED_AT, "finished_at %s is not a string" % shown(finished))
    finished_at = parse_timestamp(finished)
    if finished_at is None:
        return Parsed(BAD_FINISHED_AT, "finished_at %s is not ISO 8601" % shown(finished))
    return Parsed(OK, rc=rc, rank=rank, reason=reason, finished_at=finished_at)
