"""The agent's orchestration: one rank's way through the completion-marker protocol.

The coordinator waits for every engine, starts its sidecar and the router, runs the
benchmark sweep and publishes the marker; a worker waits for its engine, then for the
marker, its engine's death or the coordinator's silence. Both decide one rc and exit with
it (see the package docstring for the codes). The stages before the benchmark are
`bringup`'s, the sweep is `sweep`'s, a SIGTERM is handled as `stop` describes; children
are started and stopped through `processes`, the marker goes through `marker`, the status
file through `status`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

from .. import common as shared
from .. import marker_format
from . import bringup, processes, stop, sweep
from .config import ConfigError
from .errors import LocalFailure, Terminated
from .files import now_iso, write_atomic
from .health import interface_of, node_address
from .hooks import Faults, NoFaults
from .marker import marker_exit, marker_path, publish_marker, read_marker
from .processes import rc_text
from .status import Silence, peer_alive, peer_failures, start_heartbeat, write_status_file
from .stop import POLL_S
from .templates import Values, expand_known, expand_template
from .topology import Role

__all__ = ["Agent", "LocalFailure"]


class Agent(object):
    """One rank of the run. `cfg` is the loaded config (defaults filled in,
    `config.load_config`); `faults` the fault hooks (`hooks.NoFaults` in production)."""

    def __init__(
        self,
        cfg: Dict[str, Any],
        rank: int,
        job_id: str,
        hosts: List[str],
        faults: Optional[Faults] = None,
    ) -> None:
        self.cfg = cfg
        self.job_id = job_id
        self.role = Role(rank, cfg)
        self.rank = rank
        self.hosts = hosts
        self.faults: Faults = NoFaults() if faults is None else faults
        self._address: Optional[Tuple[str, str]] = None
        self.log_dir = str(cfg["log_dir"])
        self.job_dir = os.path.join(self.log_dir, job_id)
        self.node_dir = os.path.join(self.job_dir, shared.NODE_DIR)
        eng = cfg["engine"]
        self.port_base = int(eng["port"])
        self.port_stride = int(eng["port_stride"])
        self.grace_s = float(cfg["grace_s"])
        self.stop_timeout_s = float(cfg["stop_timeout_s"])
        self.heartbeat_s = float(cfg["heartbeat_s"])
        self.marker_grace_s = float(cfg["marker_grace_s"])
        self.silence_s = float(cfg["coordinator_silence_s"])
        self.health_timeout_s = float(eng["health_timeout_s"])
        self.health_path = str(eng["health_path"])
        self.connect_s = float(eng["connect_timeout_s"])
        self.read_s = float(eng["read_timeout_s"])
        self.linger_s = float(cfg["exit_linger_s"])

        self.engine: Optional["subprocess.Popen[bytes]"] = None
        self.engine_rc: Optional[int] = None
        self.bench: Optional["subprocess.Popen[bytes]"] = None
        self.state = shared.STATE_STARTING
        self.reason = ""
        self.final_rc: Optional[int] = None
        self.local_rc: Optional[int] = None
        self.failed_component: Optional[str] = None  # what failed here: engine, sidecar, ...
        self.healthy: List[str] = []  # what passed its own health check here (engine, sidecar)
        self.failed_rank: Optional[int] = None  # ... on which rank (another: not answering)
        self.failed_rc: Optional[int] = None  # ... with which rc (local_rc: workers only)
        self.start_error: Optional[LocalFailure] = None
        self.engine_log = ""
        self.marker_published = False
        self.term = stop.TermFlag()
        self.term_handled = False
        self._lock = threading.Lock()
        self._status_seq = 0
        # Each stage with its deadline and how it ended (in the status file, see stage()).
        self.stages: List[Dict[str, Any]] = []
        # Router and sidecar processes this rank started: name -> process (in the
        # engine's process group, so every stop of the engine stops them too).
        self.services: Dict[str, "subprocess.Popen[bytes]"] = {}
        self._log_fh: Any = None

    # ---- paths and naming

    def host_of(self, rank: int) -> str:
        return self.hosts[rank]

    @property
    def address(self) -> Tuple[str, str]:
        """This node's IPv4 address and interface (found once, when first asked)."""
        if self._address is None:
            forced = self.faults.node_ip()
            if forced:
                self._address = (forced, interface_of(forced))
            else:
                name = os.environ.get("SLURMD_NODENAME") or self.host_of(self.rank)
                self._address = node_address(name)
        return self._address

    def ip_of(self, rank: int) -> str:
        """A rank's IPv4 address (this node's own, or its host name resolved)."""
        if rank == self.rank:
            return self.address[0]
        try:
            return socket.gethostbyname(self.host_of(rank))
        except OSError as exc:
            raise ConfigError(
                "cannot resolve %r (rank %d): %s" % (self.host_of(rank), rank, exc)
            ) from None

    def port_of(self, rank: int) -> int:
        return self.port_base + rank * self.port_stride

    def status_path(self, rank: int) -> str:
        return os.path.join(self.job_dir, shared.status_name(rank))

    def rank_label(self, rank: int) -> str:
        role = Role(rank, self.cfg)
        return "rank %d (%s, %s:%d)" % (rank, role.name, self.host_of(rank), self.port_of(rank))

    def other_ranks(self) -> List[int]:
        return [
            r for r in range(self.role.prefill_nodes + self.role.decode_nodes) if r != self.rank
        ]

    # ---- logging and status

    def log(self, event: str, **fields: Any) -> None:
        parts = [
            "%s=%s" % (k, json.dumps(v) if isinstance(v, str) else v) for k, v in fields.items()
        ]
        line = "%s llmd-agent rank=%d role=%s %s %s" % (
            now_iso(),
            self.rank,
            self.role.name,
            event,
            " ".join(parts),
        )
        line = line.rstrip()
        print(line, flush=True)
        if self._log_fh is not None:
            try:
                self._log_fh.write(line + "\n")
                self._log_fh.flush()
            except OSError:
                pass

    def set_state(self, state: str, reason: Optional[str] = None) -> None:
        with self._lock:
            self.state = state
            if reason is not None:
                self.reason = reason
        self.log("state", state=state, reason=self.reason)
        self.write_status()

    def mark_healthy(self, component: str) -> None:
        """`component` passed its own health check on this rank (evidence that the node
        could run it, for the daemon's cause of a failure elsewhere)."""
        with self._lock:
            if component not in self.healthy:
                self.healthy.append(component)
        self.write_status()

    def stage(self, name: str, deadline_s: float) -> None:
        """Begin stage `name`, which must end within `deadline_s` (or fail the run)."""
        with self._lock:
            self.stages.append(
                {
                    "name": name,
                    "state": "running",
                    "deadline_s": deadline_s,
                    "started_at": now_iso(),
                }
            )
        self.log("stage.started", stage=name, deadline_s=deadline_s)
        self.write_status()
        if self.faults.hangs_in(name):  # a hung agent (fault hook)
            self.log("stage.hanging", stage=name)
            while True:  # past its deadline: only a TERM ends it (the supervisor's)
                self.check_term()
                time.sleep(0.2)

    def stage_end(self, failed: Optional[str] = None, diagnose: bool = True) -> None:
        """End the current stage: done, or failed with `failed` (and, with `diagnose`,
        network diagnostics)."""
        with self._lock:
            if not self.stages or self.stages[-1]["state"] != "running":
                return
            current = self.stages[-1]
            current.update(state="failed" if failed else "done", ended_at=now_iso())
            if failed:
                current["detail"] = failed
        self.log("stage." + current["state"], stage=current["name"], detail=failed or "")
        if failed and diagnose:
            self.write_network_diag(current["name"], failed)
        self.write_status()

    def write_network_diag(self, stage: str, why: str) -> None:
        """What a person would look at when a stage failed: this node's addresses, routes
        and listening sockets (``rank<r>.net.txt`` in the job directory)."""
        lines = ["llmd-agent network diagnostic: stage %s failed" % stage, "why: %s" % why]
        for argv in (["ip", "-4", "addr"], ["ip", "-4", "route"], ["ss", "-ltn"]):
            lines += ["", "$ " + " ".join(argv)]
            try:
                out = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    timeout=5,
                    check=False,
                ).stdout
                lines.append(out.decode("utf-8", "replace")[:20000].rstrip())
            except (OSError, subprocess.SubprocessError) as exc:
                lines.append("(could not run: %s)" % exc)
        path = os.path.join(self.job_dir, "rank%d.net.txt" % self.rank)
        try:
            write_atomic(path, ("\n".join(lines) + "\n").encode("utf-8"), durable=False)
        except OSError as exc:
            self.log("diag.error", error=str(exc))

    def where(self, rank: int, port: int, path: str = "") -> str:
        """How a stage failure names a rank's endpoint: ``rank 3 (decode, node4) on
        10.77.0.14:8000/health``."""
        try:
            ip = self.ip_of(rank)
        except ConfigError:
            ip = self.host_of(rank)
        role = Role(rank, self.cfg)
        return "rank %d (%s, %s) on %s:%d%s" % (rank, role.name, self.host_of(rank), ip, port, path)

    def write_status(self) -> None:
        with self._lock:
            self._status_seq += 1
            status = {
                "role": self.role.name,
                "rank": self.rank,
                "job_id": self.job_id,
                "host": self.claimed_host(),
                "hostname": socket.gethostname(),
                "port": self.port_of(self.rank),
                "pid": os.getpid(),
                "engine_pid": self.engine.pid if self.engine is not None else None,
                "bench_pid": self.bench.pid if self.bench is not None else None,
                "engine_rc": self.engine_rc,
                "state": self.state,
                "reason": self.reason,
                "rc": self.final_rc,
                "local_rc": self.local_rc,
                "failed_component": self.failed_component,
                "healthy": list(self.healthy),
                "failed_rank": self.failed_rank,
                "failed_rc": self.failed_rc,
                "seq": self._status_seq,
                "updated_at": now_iso(),
                "stages": [dict(st) for st in self.stages],
            }
            try:
                write_status_file(self.status_path(self.rank), status)
            except OSError as exc:
                print("llmd-agent rank=%d status write failed: %s" % (self.rank, exc), flush=True)

    def heartbeat(self) -> None:
        self.poll_engine()
        self.write_status()

    def claimed_host(self) -> str:
        """The host this rank's status file names: its own (a fault hook may make it lie,
        as a hostile job's would)."""
        return self.faults.status_host() or self.host_of(self.rank)

    # ---- signals

    def check_term(self) -> None:
        if self.term.received and self.final_rc is None and not self.term_handled:
            raise Terminated()

    def sleep(self, seconds: float) -> None:
        """Sleep, waking up early (with Terminated) on SIGTERM."""
        deadline = time.monotonic() + seconds
        while True:
            self.check_term()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(POLL_S, left))

    # ---- engine and services

    def template_values(self) -> Values:
        r = self.role
        return Values(
            {
                "rank": str(self.rank),
                "role": r.role,
                "host": self.host_of(self.rank),
                "port": str(self.port_of(self.rank)),
                "group": str(r.group),
                "group_rank": str(r.group_rank),
                "group_size": str(r.group_size),
                "leader_host": self.host_of(r.leader_rank),
                "leader_port": str(self.port_of(r.leader_rank)),
                # Found only when a template names them (see Values).
                "host_ip": lambda: self.address[0],
                "iface": lambda: self.address[1],
                "leader_ip": lambda: self.ip_of(r.leader_rank),
                "gpus_per_node": str(self.cfg["gpus_per_node"]),
                "model_path": str(self.cfg["model_path"]),
                "served_name": str(self.cfg["served_name"]),
                "log_dir": self.log_dir,
                "job_dir": self.job_dir,
                "node_dir": self.node_dir,
                "job_id": self.job_id,
            }
        )

    def role_env(self, role: str) -> Dict[str, str]:
        env = dict(os.environ)
        envs = self.cfg["env"]
        values = self.template_values()
        for table in ("common", role):
            env.update(
                {str(k): expand_known(str(v), values) for k, v in envs.get(table, {}).items()}
            )
        r = self.role
        env.update(
            {
                "LLMD_RANK": str(self.rank),
                "LLMD_ROLE": r.role,
                "LLMD_JOB_ID": self.job_id,
                "LLMD_LOG_DIR": self.log_dir,
                "LLMD_JOB_DIR": self.job_dir,
                "LLMD_GROUP": str(r.group),
                "LLMD_GROUP_RANK": str(r.group_rank),
                "LLMD_GROUP_SIZE": str(r.group_size),
                "LLMD_LEADER_HOST": self.host_of(r.leader_rank),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def start_engine(self) -> None:
        values = self.template_values()
        argv = [expand_template(a, values) for a in self.cfg["engine"][self.role.role]["command"]]
        log_path = os.path.join(self.job_dir, "rank%d.%s.engine.log" % (self.rank, self.role.role))
        self.engine_log = log_path
        self.log("engine.start", argv=" ".join(argv), log=log_path)
        try:
            self.engine = processes.spawn(
                argv, log_path, self.role_env(self.role.role), self.job_dir
            )
        except OSError as exc:
            raise LocalFailure(
                shared.RC_ENGINE_START, "engine could not be started: %s" % exc
            ) from exc
        self.log("engine.started", pid=self.engine.pid)
        self.write_status()

    def poll_engine(self) -> Optional[int]:
        """Return the engine's exit status once it has exited (negative = signal)."""
        eng = self.engine
        if eng is None:
            return None
        with self._lock:
            rc = eng.poll()
            if rc is not None and self.engine_rc is None:
                self.engine_rc = rc
        return rc

    def stop_group(self, proc: Optional["subprocess.Popen[bytes]"], what: str) -> List[str]:
        """`processes.stop_group` within this rank's stop timeout; the engine's exit status
        is recorded once it is reaped."""
        killed = processes.stop_group(proc, what, self.stop_timeout_s, self.log)
        if proc is not None and proc is self.engine:
            self.poll_engine()
        return killed

    # ---- other ranks

    def failed_ranks(self) -> List[Tuple[int, int, str]]:
        """(rank, rc, reason) of other ranks whose status file reports a local failure."""
        return peer_failures(self.job_dir, self.job_id, self.other_ranks())

    def raise_if_others_failed(self) -> None:
        failures = self.failed_ranks()
        if failures:
            r, rc, why = failures[0]
            raise LocalFailure(rc, "%s failed: %s" % (self.rank_label(r), why), from_rank=r)

    # ---- coordinator

    def run_coordinator(self) -> int:
        deadline = time.monotonic() + self.health_timeout_s
        try:
            if self.start_error is not None:
                raise self.start_error
            self.set_state(shared.STATE_WAITING_ENGINES)
            self.stage("engines-healthy", self.health_timeout_s)
            bringup.wait_all_engines(self, deadline)
            self.stage_end()
            bringup.start_own_sidecar(self)
            router_url = bringup.start_router(self) if self.cfg.get("router") else None
            rc, reason = sweep.run_sweep(self, router_url)
        except LocalFailure as exc:
            rc, reason = exc.rc, exc.reason
            if exc.from_rank is None:
                reason = "%s: %s" % (self.rank_label(self.rank), reason)
            self.record_failure(exc)
            self.stage_end(failed=reason)
            self.log("run.failed", rc=rc, reason=reason)
        delay = self.faults.marker_delay_s()
        if delay > 0:
            self.log("fault.marker_delay", seconds=delay)
            self.sleep(delay)
        self.stage("marker-published", 60.0)
        self.publish(rc, reason)
        self.stage_end()
        self.final_rc = rc
        self.set_state(shared.STATE_STOPPING, reason)
        self.stop_group(self.engine, "engine")
        self.linger_for_workers()
        return rc

    def publish(self, rc: int, reason: str) -> None:
        if self.marker_published:
            return
        self.set_state(shared.STATE_PUBLISHING, reason)
        publish_marker(
            self.log_dir,
            self.job_id,
            self.rank,
            rc,
            reason,
            slow_s=self.faults.marker_slow_write_s(),
        )
        self.marker_published = True
        self.log(
            "marker.published", rc=rc, reason=reason, path=marker_path(self.log_dir, self.job_id)
        )

    def linger_for_workers(self) -> None:
        """Wait (bounded) for the other live ranks to exit before exiting ourselves.

        With ``srun --kill-on-bad-exit=1`` the first nonzero exit kills the others; letting
        the workers exit first keeps every rank's rc equal to the marker's rc. Ranks with
        no status file or a stale one (never started, or dead) are not waited for.
        """
        if self.final_rc == 0:
            return
        others = self.other_ranks()
        deadline = time.monotonic() + self.linger_s
        stale_s = max(2.0, 3 * self.heartbeat_s)
        while others and time.monotonic() < deadline:
            others = [r for r in others if peer_alive(self.status_path(r), stale_s)]
            time.sleep(POLL_S)

    # ---- workers

    def run_worker(self) -> int:
        silence = Silence(self.status_path(self.role.prefill_nodes), self.silence_s)
        lag = self.faults.marker_lag_s()
        try:
            if self.start_error is not None:
                raise self.start_error
            self.set_state(shared.STATE_WAITING_HEALTH)
            if bringup.health_checked(self, self.rank):
                bringup.wait_own_health(self, time.monotonic() + self.health_timeout_s)
            bringup.start_own_sidecar(self)
            self.set_state(shared.STATE_READY)
            while True:
                self.check_term()
                marker = read_marker(self.log_dir, self.job_id, lag)
                if marker is not None:
                    return self.finish_from_marker(marker)
                rc = self.poll_engine()
                if rc is not None:
                    raise LocalFailure(
                        shared.RC_ENGINE_DIED,
                        "engine exited with %s before the marker" % rc_text(rc),
                    )
                bringup.check_services(self)
                if silence.expired():
                    self.set_state(
                        "coordinator_silent",
                        "coordinator status unchanged for %gs" % self.silence_s,
                    )
                    marker = self.wait_marker(self.marker_grace_s, lag)
                    if marker is not None:
                        return self.finish_from_marker(marker)
                    self.final_rc = shared.RC_COORDINATOR_SILENT
                    self.set_state(
                        shared.STATE_STOPPING,
                        "coordinator %s silent for %gs and no marker within %gs"
                        % (
                            self.rank_label(self.role.prefill_nodes),
                            self.silence_s,
                            self.marker_grace_s,
                        ),
                    )
                    self.stop_group(self.engine, "engine")
                    return shared.RC_COORDINATOR_SILENT
                self.sleep(0.5)
        except LocalFailure as exc:
            # Tell the coordinator (status file), then give it a bounded time to publish.
            self.set_local_failure(exc)
            marker = self.wait_marker(self.marker_grace_s, lag)
            if marker is not None:
                return self.finish_from_marker(marker)
            self.final_rc = exc.rc
            self.set_state(
                shared.STATE_STOPPING, exc.reason + "; no marker within %gs" % self.marker_grace_s
            )
            self.stop_group(self.engine, "engine")
            return exc.rc

    def record_failure(self, exc: LocalFailure) -> None:
        """What failed and where, for the status file (the daemon's cause); the
        coordinator records it too, though its own failure goes into the marker."""
        with self._lock:
            self.failed_component = exc.component
            self.failed_rank = self.rank if exc.from_rank is None else exc.from_rank
            self.failed_rc = exc.rc

    def set_local_failure(self, exc: LocalFailure) -> None:
        """Record a local failure in the status file, where the coordinator looks for it."""
        self.stage_end(failed=exc.reason)
        with self._lock:
            self.local_rc = exc.rc
        self.record_failure(exc)
        self.log("local.failure", rc=exc.rc, reason=exc.reason)
        self.set_state(
            shared.STATE_ENGINE_DIED if exc.rc == shared.RC_ENGINE_DIED else shared.STATE_FAILED,
            exc.reason,
        )

    def wait_marker(self, seconds: float, lag: float) -> Optional[marker_format.Parsed]:
        deadline = time.monotonic() + seconds
        while True:
            self.check_term()
            marker = read_marker(self.log_dir, self.job_id, lag)
            if marker is not None or time.monotonic() >= deadline:
                return marker
            time.sleep(POLL_S)

    def marker_exit(self, marker: marker_format.Parsed) -> Tuple[int, str]:
        """`marker.marker_exit`, logging an invalid marker as ``marker.invalid``."""
        rc, why = marker_exit(marker)
        if not marker.ok:
            self.log(
                "marker.invalid",
                rc=marker.rc_shown or "",
                status=marker.status,
                detail=marker.detail,
                exit=rc,
            )
        return rc, why

    def finish_from_marker(self, marker: marker_format.Parsed) -> int:
        rc, why = self.marker_exit(marker)
        self.final_rc = rc
        self.log("marker.seen", rc=rc, from_rank=marker.rank, reason=marker.reason or "")
        self.set_state(shared.STATE_STOPPING, why)
        self.stop_group(self.engine, "engine")
        return rc

    # ---- SIGTERM

    # ---- main

    def run(self) -> int:
        os.makedirs(self.job_dir, exist_ok=True)
        # Kept open for the agent's whole life; closed by process exit.
        self._log_fh = open(  # noqa: SIM115
            os.path.join(self.job_dir, "rank%d.agent.log" % self.rank), "a"
        )
        self.log(
            "start",
            job_id=self.job_id,
            host=self.host_of(self.rank),
            port=self.port_of(self.rank),
            group=self.role.group,
            group_rank=self.role.group_rank,
            leader=self.role.leader_rank,
            python=sys.version.split()[0],
        )
        self.write_status()
        # Spawn the engine before any other thread exists (see processes._child_preexec_for).
        try:
            self.start_engine()
        except LocalFailure as exc:
            self.start_error = exc
        hb, stop_heartbeat = start_heartbeat(self.heartbeat_s, self.heartbeat)
        rc = shared.RC_INTERNAL
        try:
            try:
                rc = self.run_coordinator() if self.role.is_coordinator else self.run_worker()
            except Terminated:
                rc = stop.handle_term(self)
        except Exception:
            self.log("internal_error", trace=traceback.format_exc())
            rc = shared.RC_INTERNAL
            if self.role.is_coordinator and not self.marker_published:
                with contextlib.suppress(Exception):
                    self.publish(rc, "agent internal error on rank %d" % self.rank)
            self.stop_group(self.bench, "bench")
            self.stop_group(self.engine, "engine")
        if self.term.received and not self.term_handled and self.final_rc is None:
            rc = stop.handle_term(self)
        self.final_rc = rc
        # The rc is decided: a TERM from now on (srun --kill-on-bad-exit reacting to a peer
        # that exited first) must neither change it nor kill us by the default action --
        # which is what Python restores during interpreter shutdown. Measured: ranks that
        # had logged "exit rc=7" were reported "Terminated" and srun's rc became 143.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_heartbeat.set()
        hb.join(timeout=5)
        with self._lock:
            self.state = (
                shared.STATE_TERMINATED
                if rc == shared.RC_SIGTERM and self.term_handled
                else shared.STATE_EXITED
            )
        self.write_status()
        self.log("exit", rc=rc, reason=self.reason)
        return rc
