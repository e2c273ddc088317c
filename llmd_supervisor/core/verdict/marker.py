"""Pure reading of the completion marker ``.bench_done.<jobid>`` (DESIGN.md section 4).

The coordinator publishes JSON ``{"rc": int, "job_id": str, "rank": int, "reason": str,
"finished_at": iso8601}`` with write-to-temp, fsync, rename. InferenceX's launcher writes
the rc alone as a plain integer and a newline (``7\n``), also accepted (format ``int``: no
rank, no reason; digits without the newline are a torn write). This module only
interprets bytes the caller has read (or None when the file does not exist); it never
raises. The job wrote the file: its reason and text are escaped and bounded here
(`core.run.jobtext`), so neither can stop the journal or reach a terminal as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Literal

from llmd_supervisor.core.run.jobtext import job_repr, job_text
from llmd_supervisor.core.spec.foreign import MarkerFormat
from llmd_supervisor.node import common as shared
from llmd_supervisor.node import marker_format

__all__ = [
    "MARKER_PREFIX",
    "Marker",
    "MarkerReading",
    "MarkerStatus",
    "marker_filename",
    "read_marker",
]

MARKER_PREFIX = shared.MARKER_PREFIX


def marker_filename(job_id: str) -> str:
    """The marker's file name (no directory) for ``job_id``."""
    return shared.marker_name(job_id)


# How much of a failed marker's own reason a verdict's one-line reason shows.
REASON_SHOWN = 300
# Characters of the marker file's text a reading keeps for the receipt (escaped: see
# `core.run.jobtext`); a marker the coordinator writes is about 150 bytes.
MARKER_TEXT_MAX = 8192


class MarkerStatus(StrEnum):
    """What the marker file turned out to be; only OK carries usable fields."""

    MISSING = "missing"  # no file (not written yet, or shared-filesystem lag)
    EMPTY = "empty"  # zero bytes or only whitespace
    TRUNCATED = "truncated"  # starts like a JSON object but is cut short
    NOT_JSON = "not_json"  # not UTF-8 JSON at all
    NOT_OBJECT = "not_object"  # valid JSON, but not an object
    MISSING_FIELDS = "missing_fields"  # one or more of rc/job_id/rank/reason/finished_at absent
    WRONG_JOB_ID = "wrong_job_id"  # job_id is not the job being verified
    RC_NOT_INTEGER = "rc_not_integer"  # rc is no exit status: an int from 0 to 255, no bool
    BAD_FIELD = "bad_field"  # job_id/reason not a string, or rank not an int >= 0
    BAD_FINISHED_AT = "bad_finished_at"  # finished_at is not an ISO 8601 timestamp
    REFUSED = "refused"  # not a plain file of the job (a link, FIFO, device, directory, huge)
    WRONG_FORMAT = "wrong_format"  # a valid marker, but not in the format the run declared
    NOT_USED = "not_used"  # the run uses no marker protocol (--marker-format none)
    OK = "ok"

    @property
    def may_still_arrive(self) -> bool:
        """A later read could still find a valid marker (not written or not visible yet)."""
        return self in (MarkerStatus.MISSING, MarkerStatus.EMPTY, MarkerStatus.TRUNCATED)


@dataclass(frozen=True)
class Marker:
    """A well-formed marker for the expected job."""

    rc: int
    job_id: str
    rank: int | None  # None in a plain-integer marker
    reason: str  # escaped and bounded (`core.run.jobtext`): the job wrote it
    finished_at: datetime | None  # None in a plain-integer marker
    format: Literal["json", "int"] = "json"


@dataclass(frozen=True)
class MarkerReading:
    """The result of reading one marker file: a status, a detail, and the fields when OK."""

    status: MarkerStatus
    expected_job_id: str
    detail: str  # one phrase naming what was wrong, "" when OK
    # The file's text (undecodable bytes replaced, then escaped and bounded as
    # `core.run.jobtext` does); None when missing.
    raw_text: str | None
    marker: Marker | None = None  # set exactly when status is OK
    name: str = ""  # the marker's file name ("": the rendered runs' .bench_done.<jobid>)

    @property
    def ok(self) -> bool:
        """The marker is well formed and for the expected job."""
        return self.marker is not None

    def describe(self) -> str:
        """One phrase for a verdict reason, e.g. ``marker rc=0 from rank 2``, or with a
        failure its own words: ``marker rc=73 from rank 2: rank 1 (prefill, ...) failed``."""
        if self.marker is not None:
            m = self.marker
            said = " ".join(m.reason.split())  # one line, whatever the file held
            said = said if len(said) <= REASON_SHOWN else said[: REASON_SHOWN - 3] + "..."
            # A failure is told by the rank that saw it (the marker's reason), not only by
            # the coordinator that published it.
            why = f": {said}" if m.rc != 0 and said else ""
            if m.format == "int":
                return f"marker rc={m.rc} (plain integer)"
            return f"marker rc={m.rc} from rank {m.rank}{why}"
        if self.status is MarkerStatus.NOT_USED:
            return "no marker protocol"
        name = self.name or marker_filename(self.expected_job_id)
        if self.status is MarkerStatus.MISSING:
            return f"marker {name} missing"
        return f"marker {name} {self.status.value.replace('_', ' ')}: {self.detail}"


def refused_marker(why: str, expected_job_id: str) -> MarkerReading:
    """The reading of a marker path that holds no plain file (`why` says what it is)."""
    return MarkerReading(MarkerStatus.REFUSED, expected_job_id, why, None)


def read_marker(
    data: bytes | None,
    expected_job_id: str,
    fmt: MarkerFormat = MarkerFormat.ANY,
    name: str = "",
) -> MarkerReading:
    """Interpret the marker file's bytes (None when the file is missing); never raises.

    `fmt` is the format the run declared: ``json`` or ``int`` accept only that format
    (the other is WRONG_FORMAT), ``any`` both, ``none`` reads nothing (NOT_USED).
    Every defect is its own status. Extra keys are allowed (forward compatibility).
    The rules are `node.marker_format`'s, the one reader the node agent uses too: ``rc``
    an exit status (a JSON integer from 0 to 255, not a bool), ``job_id`` the string
    ``expected_job_id``, ``finished_at`` ISO 8601 (`node.marker_format.parse_timestamp`).
    `name` is the file's name in messages (default: ``.bench_done.<job id>``).
    """
    reading = _read(data, expected_job_id)
    if fmt is MarkerFormat.NONE:
        reading = MarkerReading(MarkerStatus.NOT_USED, expected_job_id, "", None)
    elif reading.marker is not None and fmt.value not in (MarkerFormat.ANY, reading.marker.format):
        detail = f"a {reading.marker.format} marker, but the run declared --marker-format {fmt}"
        reading = MarkerReading(
            MarkerStatus.WRONG_FORMAT, expected_job_id, detail, reading.raw_text
        )
    return dataclasses.replace(reading, name=name)


def _read(data: bytes | None, expected_job_id: str) -> MarkerReading:
    """The shared reader's verdict on `data` (`node.marker_format`, as the node agent
    reads it), with the job's text escaped and bounded for the daemon."""
    parsed = marker_format.parse(data, expected_job_id, shown=job_repr)
    text = None if data is None else job_text(data.decode("utf-8", "replace"), MARKER_TEXT_MAX)
    status = MarkerStatus(parsed.status)
    if parsed.rc is None or status is not MarkerStatus.OK:
        return MarkerReading(status, expected_job_id, parsed.detail, text)
    if parsed.format == "int":
        marker = Marker(parsed.rc, expected_job_id, None, "", None, "int")
    else:
        # The reason reaches the journal, the log and terminals: escaped and bounded here.
        marker = Marker(
            parsed.rc,
            expected_job_id,
            parsed.rank,
            job_text(parsed.reason or ""),
            parsed.finished_at,
        )
    return MarkerReading(MarkerStatus.OK, expected_job_id, "", text, marker)
