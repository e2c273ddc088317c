"""Node health decisions for a watched allocation (pure).

The attempt's watcher probes each node every heartbeat (status file, log listing, marker)
and hands the result here with the time; `observe` returns the node's new health and the
events to journal and log. Times are `time.monotonic()` seconds, passed in.

A node is silent when its probes fail (SSH does not answer) **or** when its rank's status
file, which the agent rewrites every 2 s while it runs, has not been updated for longer
than the silence limit: the only liveness there is without SSH (``access = "shared-fs"``),
and an agent that hangs behind a working SSH connection is silent too. A status file in a
final state (the agent exited) is never stale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from llmd_supervisor.core.run.jobtext import job_text


@dataclass(frozen=True)
class HealthLimits:
    node_silent_s: float  # no successful probe for this long: the node is unreachable
    log_stall_s: float  # the node's logs did not grow for this long: stalled


@dataclass(frozen=True)
class Probe:
    """One heartbeat's result for one node."""

    ok: bool
    agent_state: str | None = None  # from the rank's status file, when read
    log_bytes: int | None = 0  # bytes of the node's log copies so far (None: none watched)
    error: str = ""
    # Seconds since the status file's updated_at (wall clock), if read and not final.
    status_age_s: float | None = None


@dataclass(frozen=True)
class NodeHealth:
    """What is known about one node of the current attempt."""

    node: str
    rank: int
    since: float  # when watching began (a node never reached is silent since then)
    reachable: bool = False
    last_ok: float | None = None
    agent_state: str = ""
    unreachable_reported: bool = False
    log_bytes: int = -1
    grown_at: float | None = None
    stalled: bool = False


@dataclass(frozen=True)
class NodeUnreachable:
    node: str
    rank: int
    silent_s: float
    error: str


@dataclass(frozen=True)
class LogStalled:
    node: str
    rank: int
    quiet_s: float


HealthEvent = NodeUnreachable | LogStalled


def observe(
    health: NodeHealth, probe: Probe, now: float, limits: HealthLimits
) -> tuple[NodeHealth, tuple[HealthEvent, ...]]:
    """Fold one probe into a node's health; each condition is reported once until it clears."""
    events: list[HealthEvent] = []
    stale = probe.status_age_s is not None and probe.status_age_s > limits.node_silent_s
    if probe.ok and not stale:
        health = replace(
            health,
            reachable=True,
            last_ok=now,
            unreachable_reported=False,
            agent_state=health.agent_state if probe.agent_state is None else probe.agent_state,
        )
    else:
        silent = now - (health.last_ok if health.last_ok is not None else health.since)
        error = probe.error
        if probe.ok:  # answered, but its agent has not written its status for that long
            assert probe.status_age_s is not None
            silent = probe.status_age_s
            error = f"rank {health.rank}'s status file was last updated {silent:.0f} s ago"
        health = replace(health, reachable=False)
        if silent > limits.node_silent_s and not health.unreachable_reported:
            health = replace(health, unreachable_reported=True)
            events.append(NodeUnreachable(health.node, health.rank, round(silent, 1), error))
    if probe.log_bytes is None:  # no log of this node is copied: nothing to stall
        pass
    elif probe.log_bytes != health.log_bytes:
        health = replace(health, log_bytes=probe.log_bytes, grown_at=now, stalled=False)
    else:
        quiet = now - (health.grown_at if health.grown_at is not None else health.since)
        if not health.stalled and quiet > limits.log_stall_s:
            health = replace(health, stalled=True)
            events.append(LogStalled(health.node, health.rank, round(quiet, 1)))
    return health, tuple(events)


@dataclass(frozen=True)
class Overdue:
    """A stage an agent has run past its own deadline (it should have failed it itself:
    the agent is hung)."""

    stage: str
    deadline_s: float
    over_s: float


def overdue_stage(stages: object, now: float, margin_s: float) -> Overdue | None:
    """The running stage of a status file's ``stages`` (a list of objects with ``name``,
    ``state``, ``deadline_s``, ``started_at``) that is more than `margin_s` past its
    deadline at `now` (epoch seconds), or None. Anything malformed is no evidence; the
    stage's name (the job wrote it) is escaped and bounded (`core.run.jobtext`)."""
    if not isinstance(stages, list) or not stages or not isinstance(stages[-1], dict):
        return None
    last = stages[-1]
    name, state = last.get("name"), last.get("state")
    deadline, started = last.get("deadline_s"), last.get("started_at")
    if state != "running" or not isinstance(name, str) or not isinstance(started, str):
        return None
    if not isinstance(deadline, int | float) or isinstance(deadline, bool) or len(started) > 40:
        return None
    try:
        begun = datetime.fromisoformat(started).timestamp()
    except ValueError:
        return None
    over = now - begun - float(deadline)
    return Overdue(job_text(name, 80), float(deadline), round(over, 1)) if over > margin_s else None
