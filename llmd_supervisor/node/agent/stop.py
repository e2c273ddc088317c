"""SIGTERM on a node: noticing it, the diagnostic, and leaving together with the peers.

The handler only records the TERM (`TermFlag`); the agent's loops check it between steps
(`Terminated`) and the agent then stops its children, writes ``rank<r>.diag.txt`` and
exits 143 -- unless its rc was decided already, or (a worker) the marker is already there.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

from .. import common as shared
from . import processes
from .errors import Terminated
from .files import now_iso, tail_lines, write_atomic
from .marker import marker_exit, read_marker
from .processes import rc_text
from .status import peer_still_stopping
from .view import TermFlag

if TYPE_CHECKING:
    from .view import AgentView

__all__ = ["EARLY_TERM", "TermFlag", "Terminated", "handle_term"]

# After its own SIGTERM handling a rank waits this long for peers to report "terminating".
TERM_NOTICE_S = 2.0
POLL_S = 0.2


# A TERM that arrives before the agent exists (while the config is read) is kept here.
EARLY_TERM = TermFlag()


def diag_text(
    head: List[str],
    procs: List[Tuple[int, int, str]],
    killed: List[str],
    stop_timeout_s: float,
    engine_log: str,
    engine_tail: Optional[List[str]],
) -> str:
    """The diagnostic a rank writes on SIGTERM: `head` (who, state, marker), the processes
    of its children's groups at the TERM, what needed SIGKILL, and the engine log's tail."""
    lines = ["llmd-agent diagnostic: SIGTERM", *head]
    lines += ["", "processes in the engine/bench process groups at SIGTERM (pid pgid cmdline):"]
    lines += ["  %d %d %s" % p for p in procs] or ["  (none)"]
    lines += ["", "needed SIGKILL after %gs:" % stop_timeout_s]
    lines += ["  " + k for k in killed] or ["  (none)"]
    if engine_tail is not None:
        lines += ["", "last lines of %s:" % engine_log]
        lines += ["  " + ln for ln in engine_tail]
    return "\n".join(lines) + "\n"


def _wait_for_peers(
    start: float,
    deadline: float,
    others: List[int],
    still_stopping: Callable[[int, bool], bool],
) -> Tuple[List[int], bool]:
    """Wait while another rank is still stopping after its own TERM (see
    `linger_after_term`), until `deadline`: the ranks still stopping at the end, and
    whether it waited at all."""
    waited = False
    while True:
        noticing = time.monotonic() < start + TERM_NOTICE_S
        others = [r for r in others if still_stopping(r, noticing)]
        if not others or time.monotonic() >= deadline:
            return others, waited
        waited = True
        time.sleep(POLL_S)


def handle_term(agent: "AgentView") -> int:
    """Stop `agent`'s rank after a SIGTERM; its exit status.

    The coordinator publishes a marker with rc 143 (naming earlier failures of other
    ranks) unless it has published one; every rank stops its benchmark client and engine
    (TERM, its stop timeout, KILL) and writes ``rank<r>.diag.txt``. A worker that finds
    the marker already there exits with the marker's rc; anyone else exits 143 once its
    peers have left too (`linger_after_term`)."""
    agent.term_handled = True
    state_at_term = agent.state
    agent.log("sigterm", state=state_at_term)
    with agent._lock:
        agent.state = shared.STATE_TERMINATING
        agent.reason = "sigterm in state %s" % state_at_term
    agent.write_status()
    if agent.role.is_coordinator and not agent.marker_published:
        reason = "sigterm"
        failures = agent.failed_ranks()
        if failures:
            reason += "; earlier: " + "; ".join(
                "%s failed: %s" % (agent.rank_label(r), why) for r, _, why in failures
            )
        try:
            agent.publish(shared.RC_SIGTERM, reason)
        except OSError as exc:
            agent.log("marker.error", error=str(exc))
    engine_procs: List[Tuple[int, int, str]] = []
    if agent.engine is not None:
        engine_procs = processes.list_processes(agent.engine.pid)
    bench_procs: List[Tuple[int, int, str]] = []
    if agent.bench is not None and agent.bench.poll() is None:
        bench_procs = processes.list_processes(agent.bench.pid)
    killed = agent.stop_group(agent.bench, "bench") + agent.stop_group(agent.engine, "engine")
    rc = shared.RC_SIGTERM
    if not agent.role.is_coordinator:
        # A marker that is already there decides: the TERM is most likely srun
        # --kill-on-bad-exit reacting to a peer that saw the marker first and exited
        # with its nonzero rc. Exiting 143 here would make srun's rc (the highest task
        # rc) 143 instead of the marker's rc.
        marker = read_marker(agent.log_dir, agent.job_id, agent.faults.marker_lag_s())
        if marker is not None:
            rc, why = agent.marker_exit(marker)
            agent.log("sigterm.marker", rc=rc, from_rank=marker.rank, reason=marker.reason or "")
            with agent._lock:
                agent.reason = "sigterm after " + why
    agent.final_rc = rc
    write_diag(agent, state_at_term, engine_procs + bench_procs, killed)
    if rc == shared.RC_SIGTERM:
        with agent._lock:
            agent.state = shared.STATE_TERMINATED
        agent.write_status()
        linger_after_term(agent)
    return rc


def linger_after_term(agent: "AgentView") -> None:
    """After our own TERM handling, wait (within the grace) for the other ranks' own.

    A cancel with ``--signal=TERM`` and the time limit TERM every rank at once. The first
    rank to exit 143 makes ``srun --kill-on-bad-exit`` terminate the step, and Slurm
    SIGKILLs what is left after its KillWait (30 s by default, 5 s on the dev
    cluster) -- possibly less than our grace, so a rank still stopping a slow engine
    would die without its diagnostic and turn srun's rc into 137. Ranks therefore
    leave together: each waits while another rank reports ``terminating`` (it got
    its TERM and is still stopping), or until the grace is nearly used up. A rank in
    any other unfinished state is waited for only ``TERM_NOTICE_S`` after our TERM
    (time to notice its own): it may be dead -- a killed agent's status file stays
    fresh-looking for a while -- and waiting for it would outlast Slurm's KillWait.
    """
    start = agent.term.at if agent.term.at is not None else time.monotonic()
    deadline = start + max(agent.stop_timeout_s + 0.5, agent.grace_s - 1.0)
    stale_s = max(2.0, 3 * agent.heartbeat_s)
    others, waited = _wait_for_peers(
        start,
        deadline,
        agent.other_ranks(),
        lambda r, noticing: peer_still_stopping(agent.status_path(r), stale_s, noticing),
    )
    if waited:
        agent.log("sigterm.linger_done", still_running=",".join(map(str, others)))


def write_diag(
    agent: "AgentView", state_at_term: str, procs: List[Tuple[int, int, str]], killed: List[str]
) -> None:
    marker = read_marker(agent.log_dir, agent.job_id)
    head = [
        "time: %s" % now_iso(),
        "job_id: %s  rank: %d  role: %s  host: %s  hostname: %s"
        % (
            agent.job_id,
            agent.rank,
            agent.role.name,
            agent.host_of(agent.rank),
            socket.gethostname(),
        ),
        "state at SIGTERM: %s" % state_at_term,
        "agent pid: %d" % os.getpid(),
        "engine pid: %s  engine exit: %s"
        % (
            agent.engine.pid if agent.engine is not None else None,
            rc_text(agent.engine_rc) if agent.engine_rc is not None else "running at TERM",
        ),
        "marker: %s" % (marker_exit(marker)[1] if marker is not None else "absent"),
    ]
    engine_tail = tail_lines(agent.engine_log) if agent.engine is not None else None
    text = diag_text(head, procs, killed, agent.stop_timeout_s, agent.engine_log, engine_tail)
    path = os.path.join(agent.job_dir, shared.diag_name(agent.rank))
    try:
        write_atomic(path, text.encode("utf-8"), durable=True)
        agent.log("diag.written", path=path)
    except OSError as exc:
        agent.log("diag.error", error=str(exc))
