"""llm-d node agent: one per node (one Slurm task per node), stdlib only, Python 3.9+.

It implements the completion-marker protocol of DESIGN.md section 4 inside the allocation.
The batch script writes this file, the stand-ins and a JSON config into
``<log_dir>/<job_id>/node/`` and runs ``python3 agent.py --config config.json`` under
``srun --ntasks-per-node=1``.

Roles (from ``SLURM_PROCID``, with P prefill and D decode nodes):
  * ranks ``0 .. P-1``: prefill nodes;
  * rank ``P``: the coordinator (decode leader) -- it waits for every engine, runs the
    benchmark sweep and publishes the marker;
  * ranks ``P+1 .. P+D-1``: decode workers.
Engines form groups of ``P/prefill_workers`` (``D/decode_workers``) consecutive nodes; the
first node of a group is its leader, and only leaders are handed to the benchmark.

Every rank starts its engine in its own process group (killed with the agent's parent
death signal as a last resort), logs it to ``rank<r>.<role>.engine.log``, writes a status
file ``rank<r>.status.json`` every ``heartbeat_s`` (atomically) and waits for its engine's
health endpoint until ``health_timeout_s``. The agent never relies on Slurm to reap its
engine: every exit path terminates the engine's process group (TERM, then KILL).

Files, all under the run's log directory ``L`` and job id ``J``:
  * ``L/.bench_done.J`` -- the marker, JSON ``{rc, job_id, rank, reason, finished_at}``,
    published by the coordinator only (temp file in ``L``, fsync, rename, fsync ``L``);
  * ``L/J/rank<r>.status.json`` -- heartbeat: role, rank, host, pid, engine_pid, state, rc,
    reason, updated_at;
  * ``L/J/rank<r>.agent.log``, ``L/J/rank<r>.<role>.engine.log``;
  * ``L/J/rank<r>.diag.txt`` -- written on SIGTERM: state, processes, last log lines;
  * ``L/J/bench/c<N>.json`` / ``L/J/bench/c<N>.log`` -- one benchmark point each.

Workers finish when the marker appears (exit with its rc) or when their engine dies
(re-read the marker -- listing the directory -- for up to ``marker_grace_s`` before
deciding). They also stop waiting when the coordinator's status file has not changed for
``coordinator_silence_s`` (measured on the worker's own monotonic clock, so clock skew
between nodes does not matter).

Exit codes:
  * ``0``    -- the marker says the run succeeded;
  * ``1..63`` and anything else not listed -- the marker's rc (e.g. 7: a benchmark point
    failed), passed through unchanged by every rank;
  * ``64``   -- bad invocation, config or Slurm environment;
  * ``70``   -- internal agent error (a bug; see the agent log);
  * ``71``   -- the engine could not be started;
  * ``72``   -- the local engine did not become healthy before the deadline;
  * ``73``   -- the local engine died before the marker, and no marker appeared within
    the grace;
  * ``74``   -- (coordinator) a remote engine did not become healthy before the deadline;
  * ``75``   -- (worker) the coordinator went silent and no marker appeared;
  * ``78``   -- (worker) the marker's rc is no exit status (not an integer from 0 to 255,
    or a boolean): ``marker.invalid`` in the agent log names the value;
  * ``143``  -- SIGTERM (the coordinator also publishes a marker with rc 143, reason
    ``sigterm``). After stopping its engine and writing its diagnostic a rank waits
    (within the grace) until the other ranks have finished theirs, so that srun's
    kill-on-bad-exit, triggered by the first exit, finds nothing left to SIGKILL.
When a worker fails locally (71/72/73) the coordinator notices it through the worker's
status file and publishes a marker carrying that rc and naming the rank, so all ranks end
with the same rc. Once a rank has decided its final rc, a late SIGTERM (for example from
``srun --kill-on-bad-exit``) does not change it; and a worker whose SIGTERM arrives while
the marker is already published (it had not polled it yet) exits with the marker's rc,
not 143 -- measured on Slurm 22.05: the first task exiting nonzero makes srun TERM the
others at once, and srun's rc is the highest task rc, so one 143 would turn a run's rc 7
into 143.

Fault knobs for the stand-in tests (environment of the agent, or ``env.common`` of the
spec):
  * ``LLMD_FAKE_MARKER_DELAY_S`` -- the coordinator waits this long before publishing;
  * ``LLMD_FAKE_MARKER_LAG_S`` -- a worker ignores a marker younger than this (simulated
    shared-filesystem lag);
  * ``LLMD_FAKE_MARKER_SLOW_WRITE_S`` -- the coordinator writes the temp file slowly;
  * ``LLMD_FAKE_NODE_IP`` -- this node's address for ``{host_ip}`` (tests that run every
    rank on one machine set 127.0.0.1);
  * ``LLMD_FAKE_STATUS_HOSTS`` -- a host name per rank (comma-separated) that the rank's
    status file claims instead of its own (a hostile job's words).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from http.client import HTTPConnection
from typing import Any, Dict, List, Optional, Tuple

if __package__:  # imported from the installed package (the tests)
    from . import common as shared
else:  # run from the job's node directory, where common.py lies beside this file
    import common as shared  # type: ignore[import-not-found,no-redef]

POLL_S = 0.2
# After its own SIGTERM handling a rank waits this long for peers to report "terminating".
TERM_NOTICE_S = 2.0


class ConfigError(Exception):
    """The config file or the Slurm environment is unusable."""


class Terminated(Exception):
    """SIGTERM arrived while the agent was waiting."""


# --------------------------------------------------------------------------------------
# pure helpers


_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([a-z_]+)\}|[{}]")


def expand_template(template: str, values: "Values | Dict[str, str]") -> str:
    """Replace ``{name}`` by ``values[name]``; ``{{``/``}}`` are literal braces."""

    def repl(m: "re.Match[str]") -> str:
        tok = m.group(0)
        if tok == "{{":
            return "{"
        if tok == "}}":
            return "}"
        name = m.group(1)
        if name is None:
            raise ConfigError("stray brace in command template %r" % template)
        if name not in values:
            raise ConfigError("unknown placeholder {%s} in command template %r" % (name, template))
        return values[name]

    return _PLACEHOLDER.sub(repl, template)


class Values(object):
    """Placeholder values; a callable one is computed when first looked up (so a node
    address is looked for only when a template names it)."""

    def __init__(self, values: Dict[str, Any]) -> None:
        self._values = values

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __getitem__(self, name: str) -> str:
        value = self._values[name]
        if callable(value):
            value = self._values[name] = str(value())
        return str(value)

    def get(self, name: str, default: str) -> str:
        return self[name] if name in self._values else default

    def update(self, more: Dict[str, str]) -> None:
        self._values.update(more)


def expand_known(text: str, values: "Values") -> str:
    """Replace the known ``{name}`` placeholders in an environment value; everything else
    (JSON, other braces) stays as written."""
    return re.sub(r"\{([a-z_]+)\}", lambda m: values.get(m.group(1), m.group(0)), text)


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _interface_of(ip: str) -> str:
    """The local interface that holds the IPv4 address `ip`, or "" (stdlib ioctl)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(got[20:24]) == ip:
                return name
    return ""


def node_address(node_name: str) -> Tuple[str, str]:
    """This node's IPv4 address and the interface holding it, as InferenceX finds them
    (`ip route get 1.1.1.1`): the source address of the default route, found with a UDP
    connect (no packet is sent); without a default route, the address `node_name`
    resolves to when it is one of this node's own. Raises ConfigError otherwise."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("1.1.1.1", 80))
            ip = str(s.getsockname()[0])
        except OSError:
            ip = ""
    if ip and _interface_of(ip):
        return ip, _interface_of(ip)
    try:
        ip = socket.gethostbyname(node_name)
    except OSError as exc:
        raise ConfigError(
            "cannot find this node's IPv4 address: no default route, and %r does not"
            " resolve (%s)" % (node_name, exc)
        ) from None
    iface = _interface_of(ip)
    if not iface:
        raise ConfigError(
            "cannot find this node's IPv4 address: no default route, and %r resolves to"
            " %s, which no interface here holds" % (node_name, ip)
        )
    return ip, iface


class Role(object):
    """Where a rank sits in the P/D topology."""

    def __init__(self, rank: int, cfg: Dict[str, Any]) -> None:
        p = int(cfg["prefill_nodes"])
        d = int(cfg["decode_nodes"])
        if not 0 <= rank < p + d:
            raise ConfigError("SLURM_PROCID %d is outside 0..%d" % (rank, p + d - 1))
        self.rank = rank
        self.prefill_nodes = p
        self.decode_nodes = d
        if rank < p:
            self.role = "prefill"
            size = p // int(cfg["prefill_workers"])
            local = rank
            base = 0
        else:
            self.role = "decode"
            size = d // int(cfg["decode_workers"])
            local = rank - p
            base = p
        self.group = local // size
        self.group_rank = local % size
        self.group_size = size
        self.leader_rank = base + self.group * size
        self.is_leader = self.group_rank == 0
        self.is_coordinator = rank == p

    @property
    def name(self) -> str:
        return "coordinator" if self.is_coordinator else self.role


def leader_ranks(cfg: Dict[str, Any], role: str) -> List[int]:
    p = int(cfg["prefill_nodes"])
    d = int(cfg["decode_nodes"])
    if role == "prefill":
        size = p // int(cfg["prefill_workers"])
        return list(range(0, p, size))
    size = d // int(cfg["decode_workers"])
    return list(range(p, p + d, size))


def sidecar_ranks(cfg: Dict[str, Any]) -> List[int]:
    """The decode ranks that run the P/D sidecar (none without a [sidecar])."""
    sidecar = cfg.get("sidecar")
    if not sidecar:
        return []
    p, d = int(cfg["prefill_nodes"]), int(cfg["decode_nodes"])
    return list(range(p, p + d)) if sidecar.get("on") == "all" else leader_ranks(cfg, "decode")


def endpoints_yaml(endpoints: List[Tuple[str, str, int, str]]) -> str:
    """The EPP's file-discovery endpoints file: (name, IPv4, port, role) each, the port
    as a string (upstream unmarshals it into one)."""
    lines = ["# written by the llmd agent from the allocation's node addresses", "endpoints:"]
    for name, ip, port, role in endpoints:
        lines += [
            "- name: %s" % name,
            "  address: %s" % ip,
            "  port: '%d'" % port,
            "  labels:",
            "    llm-d.ai/role: %s" % role,
        ]
    return "\n".join(lines) + "\n"


def check_tcp(host: str, port: int, timeout_s: float) -> str:
    """ "" when `host:port` accepts a TCP connection, else a short reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except socket.timeout:
        return "timed out"
    except OSError as exc:
        return exc.strerror or exc.__class__.__name__


def marker_path(log_dir: str, job_id: str) -> str:
    return os.path.join(log_dir, shared.marker_name(job_id))


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


# --------------------------------------------------------------------------------------
# files


def write_atomic(path: str, data: bytes, *, durable: bool, slow_s: float = 0.0) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the whole new one.

    The temp file lives in the same directory (rename is atomic only within a file
    system). ``durable`` adds fsync of the file before the rename and of the directory
    after it, so the rename survives a node crash and is visible to other NFS clients.
    """
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(
        directory, ".%s.tmp.%s.%d" % (os.path.basename(path), socket.gethostname(), os.getpid())
    )
    # 0600: the daemon reads these files as the same account (its SSH user, or shared fs).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if slow_s > 0:
            step = max(1, len(data) // 8)
            for i in range(0, len(data), step):
                os.write(fd, data[i : i + step])
                time.sleep(slow_s / 8)
        else:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.rename(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def publish_marker(
    log_dir: str, job_id: str, rank: int, rc: int, reason: str, slow_s: float = 0.0
) -> Dict[str, Any]:
    """Publish the completion marker atomically and durably; return what was written."""
    marker = {
        "rc": int(rc),
        "job_id": str(job_id),
        "rank": int(rank),
        "reason": reason,
        "finished_at": now_iso(),
    }
    data = (json.dumps(marker, sort_keys=True) + "\n").encode("utf-8")
    write_atomic(marker_path(log_dir, job_id), data, durable=True, slow_s=slow_s)
    return marker


def read_marker(log_dir: str, job_id: str, min_age_s: float = 0.0) -> Optional[Dict[str, Any]]:
    """Return the marker for ``job_id`` if it is visible and valid, else None.

    The directory is listed first: on NFS that refreshes the cached directory entries, so
    a marker renamed into place on another node is found without waiting for the
    attribute cache to expire.
    """
    name = shared.marker_name(job_id)
    try:
        if name not in os.listdir(log_dir):
            return None
        path = os.path.join(log_dir, name)
        if min_age_s > 0 and time.time() - os.stat(path).st_mtime < min_age_s:
            return None
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    try:
        marker = json.loads(raw.decode("utf-8"))
    except ValueError:
        return None
    if not isinstance(marker, dict) or str(marker.get("job_id")) != job_id:
        return None
    return marker  # whatever its rc: `Agent.marker_exit` decides what that stands for


def read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, "rb") as fh:
            value = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def tail_lines(path: str, n: int = 30, max_bytes: int = 16384) -> List[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError as exc:
        return ["<cannot read %s: %s>" % (path, exc)]
    return data.decode("utf-8", "replace").splitlines()[-n:]


def list_processes(pgid: Optional[int] = None) -> List[Tuple[int, int, str]]:
    """(pid, pgid, cmdline) of processes, optionally only one process group (Linux /proc)."""
    result: List[Tuple[int, int, str]] = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return result
    for pid in sorted(pids):
        try:
            group = os.getpgid(pid)
        except OSError:
            continue
        if pgid is not None and group != pgid:
            continue
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            cmd = "?"
        if not cmd:  # a zombie (or kernel thread) has no command line: name it anyway
            try:
                with open("/proc/%d/comm" % pid, "rb") as fh:
                    comm = fh.read().decode("utf-8", "replace").strip()
            except OSError:
                comm = "?"
            cmd = "[%s] (exited)" % comm
        result.append((pid, group, cmd))
    return result


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group whose members are all zombies still "exists"; look closer.
    for pid, _, _ in list_processes(pgid):
        try:
            with open("/proc/%d/stat" % pid, "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z":
            return True
    return False


# --------------------------------------------------------------------------------------
# HTTP health


def check_health(host: str, port: int, path: str, connect_s: float, read_s: float) -> str:
    """Return "" when ``GET path`` answers 200, else a short reason. Never blocks longer
    than ``connect_s + read_s`` (a listener that accepts but never answers hits
    ``read_s``)."""
    conn = HTTPConnection(host, port, timeout=connect_s)
    try:
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(read_s)
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        resp.read(4096)
        if resp.status == 200:
            return ""
        return "HTTP %d" % resp.status
    except socket.timeout:
        return "timed out"
    except OSError as exc:
        return exc.strerror or exc.__class__.__name__
    except Exception as exc:  # http.client raises a zoo of protocol errors
        return exc.__class__.__name__
    finally:
        conn.close()


# --------------------------------------------------------------------------------------
# the agent


class Agent(object):
    def __init__(self, cfg: Dict[str, Any], rank: int, job_id: str, hosts: List[str]) -> None:
        self.cfg = cfg
        self.job_id = job_id
        self.role = Role(rank, cfg)
        self.rank = rank
        self.hosts = hosts
        self._address: Optional[Tuple[str, str]] = None
        self.log_dir = str(cfg["log_dir"])
        self.job_dir = os.path.join(self.log_dir, job_id)
        self.node_dir = os.path.join(self.job_dir, "node")
        self.port_base = int(cfg["engine"]["port"])
        self.port_stride = int(cfg["engine"].get("port_stride", 0))
        self.grace_s = float(cfg["grace_s"])
        self.stop_timeout_s = float(cfg.get("stop_timeout_s", max(1.0, self.grace_s * 2 / 3)))
        self.heartbeat_s = float(cfg.get("heartbeat_s", 2.0))
        self.marker_grace_s = float(cfg.get("marker_grace_s", 10.0))
        self.silence_s = float(cfg.get("coordinator_silence_s", 60.0))
        self.health_timeout_s = float(cfg["engine"].get("health_timeout_s", 600.0))
        self.health_path = str(cfg["engine"].get("health_path", "/health"))
        self.connect_s = float(cfg["engine"].get("connect_timeout_s", 2.0))
        self.read_s = float(cfg["engine"].get("read_timeout_s", 2.0))
        self.linger_s = float(cfg.get("exit_linger_s", 10.0))

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
        self.term_received = False
        self.term_handled = False
        self.term_at: Optional[float] = None  # monotonic time of the first SIGTERM
        self._lock = threading.Lock()
        self._stop_heartbeat = threading.Event()
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
            forced = os.environ.get("LLMD_FAKE_NODE_IP")  # tests on one machine: 127.0.0.1
            if forced:
                self._address = (forced, _interface_of(forced))
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
        common = {"LLMD_RANK": str(self.rank), **self.cfg.get("env", {}).get("common", {})}
        if shared.fault("LLMD_FAKE_AGENT_HANG_STAGE", common) == name:  # a hung agent (tests)
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
            data = (json.dumps(status, sort_keys=True) + "\n").encode("utf-8")
            try:
                write_atomic(self.status_path(self.rank), data, durable=False)
            except OSError as exc:
                print("llmd-agent rank=%d status write failed: %s" % (self.rank, exc), flush=True)

    def _heartbeat_loop(self) -> None:
        while not self._stop_heartbeat.wait(self.heartbeat_s):
            self.poll_engine()
            self.write_status()

    def claimed_host(self) -> str:
        """The host this rank's status file names: its own, or (fault knob
        ``LLMD_FAKE_STATUS_HOSTS``, a hostile job's claim) the rank's name in that list."""
        common = self.cfg.get("env", {}).get("common", {})
        knob = os.environ.get("LLMD_FAKE_STATUS_HOSTS") or common.get("LLMD_FAKE_STATUS_HOSTS")
        claims = str(knob or "").split(",")
        claim = claims[self.rank].strip() if self.rank < len(claims) else ""
        return claim or self.host_of(self.rank)

    def knob(self, name: str) -> float:
        """A numeric fault knob from the agent's environment or the spec's ``env.common``."""
        common = self.cfg.get("env", {}).get("common", {})
        return _float_or_zero(os.environ.get(name) or common.get(name))

    # ---- signals

    def on_sigterm(self, signum: int, frame: Any) -> None:
        if self.term_at is None:
            self.term_at = time.monotonic()
        self.term_received = True

    def check_term(self) -> None:
        if self.term_received and self.final_rc is None and not self.term_handled:
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

    # ---- engine

    def template_values(self) -> "Values":
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
                "gpus_per_node": str(self.cfg.get("gpus_per_node", 0)),
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
        envs = self.cfg.get("env", {})
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
        with open(log_path, "ab") as out:
            try:
                self.engine = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.role_env(self.role.role),
                    cwd=self.job_dir,
                    preexec_fn=_child_preexec_for(os.getpid()),
                    close_fds=True,
                )
            except OSError as exc:
                raise LocalFailure(
                    shared.RC_ENGINE_START, "engine could not be started: %s" % exc
                ) from exc
        self.log("engine.started", pid=self.engine.pid)
        self.write_status()

    def service_values(self) -> "Values":
        """Placeholders of router and sidecar commands (and of the benchmark)."""
        values = self.template_values()
        router, sidecar = self.cfg.get("router"), self.cfg.get("sidecar")
        coordinator = self.role.prefill_nodes
        extra: Dict[str, Any] = {
            "endpoints_file": os.path.join(self.job_dir, shared.ENDPOINTS_FILE),
            "router_port": str(router["port"]) if router else "",
            "sidecar_port": str(sidecar["port"]) if sidecar else "",
        }
        if router:
            extra["router_url"] = lambda: "http://%s:%d" % (self.ip_of(coordinator), router["port"])
        values.update(extra)
        return values

    def start_service(self, svc: Dict[str, Any]) -> "subprocess.Popen[bytes]":
        """Start a router or sidecar process (log ``rank<r>.<name>.log``) in the engine's
        process group."""
        values = self.service_values()
        argv = [expand_template(a, values) for a in svc["command"]]
        name = str(svc["name"])
        log_path = os.path.join(self.job_dir, "rank%d.%s.log" % (self.rank, name))
        self.log("%s.start" % name, argv=" ".join(argv), log=log_path)
        group = self.engine.pid if self.engine is not None else None
        with open(log_path, "ab") as out:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.role_env(self.role.role),
                    cwd=self.job_dir,
                    preexec_fn=_child_preexec_for(os.getpid(), group),
                    close_fds=True,
                )
            except OSError as exc:
                raise LocalFailure(
                    shared.RC_SERVICE_DIED,
                    "%s could not be started: %s" % (name, exc),
                    component=name,
                ) from exc
        self.services[name] = proc
        self.log("%s.started" % name, pid=proc.pid)
        return proc

    def check_services(self) -> None:
        """LocalFailure if a router or sidecar process of this rank has exited."""
        for name, proc in self.services.items():
            rc = proc.poll()
            if rc is not None:
                raise LocalFailure(
                    shared.RC_SERVICE_DIED,
                    "%s exited with %s" % (name, _rc_text(rc)),
                    component=name,
                )

    def wait_healthy(
        self,
        stage: str,
        svc: Dict[str, Any],
        targets: List[Tuple[int, str]],
        proc: Optional["subprocess.Popen[bytes]"] = None,
    ) -> None:
        """Stage `stage`: every (rank, address) answers `svc`'s health check (GET its
        health_path, or a TCP connect) within its startup deadline."""
        timeout = float(svc["startup_timeout_s"])
        port, path = int(svc["port"]), svc.get("health_path")
        self.stage(stage, timeout)
        deadline = time.monotonic() + timeout
        pending = {rank: "not checked yet" for rank, _ in targets}
        addresses = dict(targets)
        while pending:
            self.check_term()
            if proc is not None and proc.poll() is not None:
                raise LocalFailure(
                    shared.RC_SERVICE_DIED,
                    "stage %s: %s exited with %s before it was healthy"
                    % (stage, svc["name"], _rc_text(proc.poll())),
                    component=svc["name"],
                )
            self.raise_if_others_failed()
            for rank in sorted(pending):
                host = addresses[rank]
                why = (
                    check_health(host, port, path, self.connect_s, self.read_s)
                    if path
                    else check_tcp(host, port, self.connect_s)
                )
                if why:
                    pending[rank] = why
                else:
                    del pending[rank]
            if not pending:
                self.stage_end()
                return
            if time.monotonic() >= deadline:
                rank = min(pending)
                raise LocalFailure(
                    shared.RC_SERVICE_UNHEALTHY,
                    "stage %s: %s of rank %d (%s) no answer on %s:%d%s after %gs (last: %s)"
                    % (
                        stage,
                        svc["name"],
                        rank,
                        self.host_of(rank),
                        addresses[rank],
                        port,
                        path or "",
                        timeout,
                        pending[rank],
                    ),
                    from_rank=None if rank == self.rank else rank,
                    component=svc["name"],
                )
            self.sleep(0.5)

    def start_own_sidecar(self) -> None:
        """On a sidecar rank: start the P/D sidecar and wait until it answers here."""
        sidecar = self.cfg.get("sidecar")
        if sidecar and self.rank in sidecar_ranks(self.cfg):
            proc = self.start_service(sidecar)
            try:
                here = self.ip_of(self.rank)  # where the other nodes reach it
            except ConfigError:
                here = "127.0.0.1"
            self.wait_healthy("sidecar-healthy", sidecar, [(self.rank, here)], proc)
            self.mark_healthy("sidecar")

    def start_router(self) -> str:
        """On the coordinator: every sidecar answers, the endpoints file is written (by
        rename), the router processes start in order and each answers; the router URL."""
        sidecar, router = self.cfg.get("sidecar"), self.cfg["router"]
        if sidecar:
            targets = [(r, self.ip_of(r)) for r in sidecar_ranks(self.cfg)]
            self.wait_healthy("sidecars-healthy", sidecar, targets)
        endpoints = [
            ("prefill-%d" % r, self.ip_of(r), self.port_of(r), "prefill")
            for r in leader_ranks(self.cfg, "prefill")
        ]
        for r in leader_ranks(self.cfg, "decode"):
            port = (
                int(sidecar["port"])
                if sidecar and r in sidecar_ranks(self.cfg)
                else self.port_of(r)
            )
            endpoints.append(("decode-%d" % r, self.ip_of(r), port, "decode"))
        path = os.path.join(self.job_dir, shared.ENDPOINTS_FILE)
        write_atomic(path, endpoints_yaml(endpoints).encode("utf-8"), durable=False)
        self.log("endpoints.written", path=path, endpoints=len(endpoints))
        for svc in router["processes"]:
            proc = self.start_service(svc)
            self.wait_healthy("%s-healthy" % svc["name"], svc, [(self.rank, "127.0.0.1")], proc)
        return self.service_values()["router_url"]

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
        """TERM the process group of ``proc``, wait up to stop_timeout_s, KILL the rest.

        Returns a description of what had to be SIGKILLed (empty if TERM was enough).
        """
        if proc is None:
            return []
        pgid = proc.pid  # the child called setsid(): its pid is its process group id
        killed: List[str] = []
        if not group_alive(pgid):
            # Already gone (e.g. Slurm signalled the whole step): still record its status.
            self._reap(proc)
            if proc is self.engine:
                self.poll_engine()
            return killed
        self.log("%s.stop" % what, pgid=pgid, signal="TERM", timeout_s=self.stop_timeout_s)
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            self._reap(proc)
            if not group_alive(pgid):
                break
            time.sleep(0.05)
        else:
            killed = ["%d %s" % (pid, cmd) for pid, _, cmd in list_processes(pgid)]
            self.log("%s.kill" % what, pgid=pgid, signal="KILL", remaining=len(killed))
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
            end = time.monotonic() + 2.0
            while time.monotonic() < end and group_alive(pgid):
                self._reap(proc)
                time.sleep(0.05)
        self._reap(proc)
        if proc is self.engine:
            self.poll_engine()
        return killed

    @staticmethod
    def _reap(proc: "subprocess.Popen[bytes]") -> None:
        with contextlib.suppress(OSError):
            proc.poll()

    def wait_own_health(self, deadline: float) -> None:
        host, port = self.host_of(self.rank), self.port_of(self.rank)
        last = ""
        while True:
            self.check_term()
            rc = self.poll_engine()
            if rc is not None:
                raise LocalFailure(
                    shared.RC_ENGINE_DIED,
                    "engine exited with %s before becoming healthy" % _rc_text(rc),
                )
            last = check_health(host, port, self.health_path, self.connect_s, self.read_s)
            if not last:
                self.log("engine.healthy", host=host, port=port)
                self.mark_healthy("engine")
                return
            if time.monotonic() >= deadline:
                raise LocalFailure(
                    shared.RC_ENGINE_UNHEALTHY,
                    "engine not healthy after %gs at %s:%d%s (last: %s)"
                    % (self.health_timeout_s, host, port, self.health_path, last),
                )
            self.sleep(0.5)

    # ---- other ranks

    def failed_ranks(self) -> List[Tuple[int, int, str]]:
        """(rank, rc, reason) of other ranks whose status file reports a local failure."""
        failures = []
        for r in range(self.role.prefill_nodes + self.role.decode_nodes):
            if r == self.rank:
                continue
            st = read_json(self.status_path(r))
            if st is None or str(st.get("job_id")) != self.job_id:
                continue
            # local_rc stays in the status after the state moves on (stopping, exited).
            rc = st.get("local_rc")
            if isinstance(rc, int) and rc > 0:
                failures.append((r, rc, str(st.get("reason", ""))))
        return failures

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
            self.wait_all_engines(deadline)
            self.stage_end()
            self.start_own_sidecar()
            router_url = self.start_router() if self.cfg.get("router") else None
            rc, reason = self.run_sweep(router_url)
        except LocalFailure as exc:
            rc, reason = exc.rc, exc.reason
            if exc.from_rank is None:
                reason = "%s: %s" % (self.rank_label(self.rank), reason)
            self.record_failure(exc)
            self.stage_end(failed=reason)
            self.log("run.failed", rc=rc, reason=reason)
        delay = self.knob("LLMD_FAKE_MARKER_DELAY_S")
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
            slow_s=self.knob("LLMD_FAKE_MARKER_SLOW_WRITE_S"),
        )
        self.marker_published = True
        self.log(
            "marker.published", rc=rc, reason=reason, path=marker_path(self.log_dir, self.job_id)
        )

    def health_checked(self, rank: int) -> bool:
        """Whether `rank`'s engine answers health checks ([engine] prefill_/decode_health:
        all, group leaders only -- followers run --headless -- or none)."""
        scope = self.cfg["engine"][Role(rank, self.cfg).role].get("health", "all")
        return scope == "all" or (scope == "leaders" and Role(rank, self.cfg).is_leader)

    def wait_all_engines(self, deadline: float) -> None:
        ranks = [
            r
            for r in range(self.role.prefill_nodes + self.role.decode_nodes)
            if self.health_checked(r)
        ]
        pending = {r: "not checked yet" for r in ranks}
        while pending:
            self.check_term()
            rc = self.poll_engine()
            if rc is not None:
                raise LocalFailure(
                    shared.RC_ENGINE_DIED,
                    "engine exited with %s before becoming healthy" % _rc_text(rc),
                )
            self.raise_if_others_failed()
            for r in sorted(pending):
                self.check_term()
                left = max(0.2, deadline - time.monotonic())
                why = check_health(
                    self.host_of(r),
                    self.port_of(r),
                    self.health_path,
                    min(self.connect_s, left),
                    min(self.read_s, left),
                )
                if why:
                    pending[r] = why
                else:
                    del pending[r]
                    self.log("engine.ready", peer=r, host=self.host_of(r), port=self.port_of(r))
                    if r == self.rank:
                        self.mark_healthy("engine")
            if not pending:
                return
            if time.monotonic() >= deadline:
                own = pending.pop(self.rank, None)
                if own is not None:
                    raise LocalFailure(
                        shared.RC_ENGINE_UNHEALTHY,
                        "engine not healthy after %gs (last: %s)" % (self.health_timeout_s, own),
                    )
                first = min(pending)
                detail = "; ".join(
                    "%s: %s" % (self.where(r, self.port_of(r), self.health_path), w)
                    for r, w in sorted(pending.items())
                )
                raise LocalFailure(
                    shared.RC_REMOTE_UNHEALTHY,
                    "stage engines-healthy: no answer after %gs from %s"
                    % (self.health_timeout_s, detail),
                    from_rank=first,
                )
            self.sleep(0.5)

    def run_sweep(self, router_url: Optional[str] = None) -> Tuple[int, str]:
        bench = self.cfg["bench"]
        bench_dir = os.path.join(self.job_dir, shared.BENCH_DIR)
        os.makedirs(bench_dir, exist_ok=True)
        prefill = [
            "http://%s:%d" % (self.host_of(r), self.port_of(r))
            for r in leader_ranks(self.cfg, "prefill")
        ]
        decode = [
            "http://%s:%d" % (self.host_of(r), self.port_of(r))
            for r in leader_ranks(self.cfg, "decode")
        ]
        final_rc = 0
        failures: List[str] = []
        points = [int(c) for c in bench["concurrencies"]]
        for i, conc in enumerate(points):
            # What `status` shows while the sweep runs.
            self.set_state(
                shared.STATE_BENCHMARKING, "concurrency %d (%d of %d)" % (conc, i + 1, len(points))
            )
            values = self.template_values()
            values.update(
                {
                    "concurrency": str(conc),
                    "num_prompts": str(conc * int(bench["prompts_multiplier"])),
                    "input_len": str(bench["input_len"]),
                    "output_len": str(bench["output_len"]),
                    "request_rate": str(bench["request_rate"]),
                    "prefill_urls": ",".join(prefill),
                    "decode_urls": ",".join(decode),
                    "result_file": os.path.join(bench_dir, shared.result_name(conc)),
                    "router_url": router_url or "",
                }
            )
            argv = [expand_template(a, values) for a in bench["command"]]
            log_path = os.path.join(bench_dir, shared.bench_log_name(conc))
            timeout = float(bench.get("point_timeout_s", 3600))
            self.stage("benchmark c=%d" % conc, timeout)
            rc = self.run_bench_point(conc, argv, log_path)
            failed = None if rc == 0 else "concurrency %d exited %s" % (conc, _rc_text(rc))
            self.stage_end(failed, diagnose=rc == 124)  # 124: over its deadline
            if rc != 0:
                failures.append("concurrency %d exited %s" % (conc, _rc_text(rc)))
                if final_rc == 0:
                    final_rc = rc if 0 < rc < 256 else 1
        if failures:
            return final_rc, "benchmark failed: " + "; ".join(failures)
        return 0, "ok: %d benchmark points passed" % len(bench["concurrencies"])

    def run_bench_point(self, conc: int, argv: List[str], log_path: str) -> int:
        timeout = float(self.cfg["bench"].get("point_timeout_s", 3600))
        self.log("bench.start", concurrency=conc, argv=" ".join(argv))
        with open(log_path, "ab") as out:
            try:
                self.bench = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.role_env("bench"),
                    cwd=self.job_dir,
                    preexec_fn=_child_preexec_for(os.getpid()),
                    close_fds=True,
                )
            except OSError as exc:
                self.log("bench.error", concurrency=conc, error=str(exc))
                return 127
        deadline = time.monotonic() + timeout
        try:
            while True:
                rc = self.bench.poll()
                if rc is not None:
                    self.log("bench.done", concurrency=conc, rc=rc)
                    return rc if rc >= 0 else 128 - rc
                erc = self.poll_engine()
                if erc is not None:
                    raise LocalFailure(
                        shared.RC_ENGINE_DIED,
                        "engine exited with %s during the benchmark" % _rc_text(erc),
                    )
                self.raise_if_others_failed()
                self.check_services()
                if time.monotonic() >= deadline:
                    self.log("bench.timeout", concurrency=conc, timeout_s=timeout)
                    self.stop_group(self.bench, "bench")
                    return 124
                self.sleep(POLL_S)
        finally:
            # On SIGTERM, handle_term stops the bench after publishing the marker.
            if self.bench.poll() is None and not self.term_received:
                self.stop_group(self.bench, "bench")

    def linger_for_workers(self) -> None:
        """Wait (bounded) for the other live ranks to exit before exiting ourselves.

        With ``srun --kill-on-bad-exit=1`` the first nonzero exit kills the others; letting
        the workers exit first keeps every rank's rc equal to the marker's rc. Ranks with
        no status file or a stale one (never started, or dead) are not waited for.
        """
        if self.final_rc == 0:
            return
        others = [
            r for r in range(self.role.prefill_nodes + self.role.decode_nodes) if r != self.rank
        ]
        deadline = time.monotonic() + self.linger_s
        stale_s = max(2.0, 3 * self.heartbeat_s)
        while others and time.monotonic() < deadline:
            others = [r for r in others if self._alive_rank(r, stale_s)]
            time.sleep(POLL_S)

    def _still_stopping(self, rank: int, stale_s: float, noticing: bool) -> bool:
        """Whether to keep waiting for ``rank`` after our own TERM handling."""
        path = self.status_path(rank)
        try:
            age = time.time() - os.stat(path).st_mtime
        except OSError:
            return False
        state = (read_json(path) or {}).get("state")
        if age >= stale_s or state in shared.GONE_STATES:
            return False
        return state == shared.STATE_TERMINATING or noticing

    def _alive_rank(self, rank: int, stale_s: float) -> bool:
        path = self.status_path(rank)
        try:
            age = time.time() - os.stat(path).st_mtime
        except OSError:
            return False
        state = (read_json(path) or {}).get("state")
        return age < stale_s and state not in shared.GONE_STATES

    # ---- workers

    def run_worker(self) -> int:
        silence = _Silence(self.status_path(self.role.prefill_nodes), self.silence_s)
        lag = self.knob("LLMD_FAKE_MARKER_LAG_S")
        try:
            if self.start_error is not None:
                raise self.start_error
            self.set_state(shared.STATE_WAITING_HEALTH)
            if self.health_checked(self.rank):
                self.wait_own_health(time.monotonic() + self.health_timeout_s)
            self.start_own_sidecar()
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
                        "engine exited with %s before the marker" % _rc_text(rc),
                    )
                self.check_services()
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

    def record_failure(self, exc: "LocalFailure") -> None:
        """What failed and where, for the status file (the daemon's cause); the
        coordinator records it too, though its own failure goes into the marker."""
        with self._lock:
            self.failed_component = exc.component
            self.failed_rank = self.rank if exc.from_rank is None else exc.from_rank
            self.failed_rc = exc.rc

    def set_local_failure(self, exc: "LocalFailure") -> None:
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

    def wait_marker(self, seconds: float, lag: float) -> Optional[Dict[str, Any]]:
        deadline = time.monotonic() + seconds
        while True:
            self.check_term()
            marker = read_marker(self.log_dir, self.job_id, lag)
            if marker is not None or time.monotonic() >= deadline:
                return marker
            time.sleep(POLL_S)

    def marker_exit(self, marker: Dict[str, Any]) -> Tuple[int, str]:
        """The exit status `marker` stands for, and a phrase saying so: its rc, or
        RC_BAD_MARKER when that is no exit status (``false``, 256, -1: what ``int`` and
        ``exit`` would turn into 0), logged as ``marker.invalid`` with the value."""
        rc = shared.marker_rc(marker.get("rc"))
        rank = _shown(marker.get("rank"))
        if rc is not None:
            return rc, "marker rc=%d from rank %s" % (rc, rank)
        value = _shown(marker["rc"]) if "rc" in marker else "missing"
        self.log("marker.invalid", rc=value, from_rank=rank, exit=shared.RC_BAD_MARKER)
        return shared.RC_BAD_MARKER, (
            "marker rc %s from rank %s is not an exit status (an integer from 0 to 255)"
            % (value, rank)
        )

    def finish_from_marker(self, marker: Dict[str, Any]) -> int:
        rc, why = self.marker_exit(marker)
        self.final_rc = rc
        self.log(
            "marker.seen", rc=rc, from_rank=marker.get("rank"), reason=marker.get("reason", "")
        )
        self.set_state(shared.STATE_STOPPING, why)
        self.stop_group(self.engine, "engine")
        return rc

    # ---- SIGTERM

    def handle_term(self) -> int:
        self.term_handled = True
        state_at_term = self.state
        self.log("sigterm", state=state_at_term)
        with self._lock:
            self.state = shared.STATE_TERMINATING
            self.reason = "sigterm in state %s" % state_at_term
        self.write_status()
        if self.role.is_coordinator and not self.marker_published:
            reason = "sigterm"
            failures = self.failed_ranks()
            if failures:
                reason += "; earlier: " + "; ".join(
                    "%s failed: %s" % (self.rank_label(r), why) for r, _, why in failures
                )
            try:
                self.publish(shared.RC_SIGTERM, reason)
            except OSError as exc:
                self.log("marker.error", error=str(exc))
        engine_procs: List[Tuple[int, int, str]] = []
        if self.engine is not None:
            engine_procs = list_processes(self.engine.pid)
        bench_procs: List[Tuple[int, int, str]] = []
        if self.bench is not None and self.bench.poll() is None:
            bench_procs = list_processes(self.bench.pid)
        killed = self.stop_group(self.bench, "bench") + self.stop_group(self.engine, "engine")
        rc = shared.RC_SIGTERM
        if not self.role.is_coordinator:
            # A marker that is already there decides: the TERM is most likely srun
            # --kill-on-bad-exit reacting to a peer that saw the marker first and exited
            # with its nonzero rc. Exiting 143 here would make srun's rc (the highest task
            # rc) 143 instead of the marker's rc.
            marker = read_marker(self.log_dir, self.job_id, self.knob("LLMD_FAKE_MARKER_LAG_S"))
            if marker is not None:
                rc, why = self.marker_exit(marker)
                self.log(
                    "sigterm.marker",
                    rc=rc,
                    from_rank=marker.get("rank"),
                    reason=marker.get("reason", ""),
                )
                with self._lock:
                    self.reason = "sigterm after " + why
        self.final_rc = rc
        self.write_diag(state_at_term, engine_procs + bench_procs, killed)
        if rc == shared.RC_SIGTERM:
            with self._lock:
                self.state = shared.STATE_TERMINATED
            self.write_status()
            self.linger_after_term()
        return rc

    def linger_after_term(self) -> None:
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
        start = self.term_at if self.term_at is not None else time.monotonic()
        deadline = start + max(self.stop_timeout_s + 0.5, self.grace_s - 1.0)
        others = [
            r for r in range(self.role.prefill_nodes + self.role.decode_nodes) if r != self.rank
        ]
        stale_s = max(2.0, 3 * self.heartbeat_s)
        waited = False
        while True:
            noticing = time.monotonic() < start + TERM_NOTICE_S
            others = [r for r in others if self._still_stopping(r, stale_s, noticing)]
            if not others or time.monotonic() >= deadline:
                break
            waited = True
            time.sleep(POLL_S)
        if waited:
            self.log("sigterm.linger_done", still_running=",".join(map(str, others)))

    def write_diag(
        self, state_at_term: str, procs: List[Tuple[int, int, str]], killed: List[str]
    ) -> None:
        lines = [
            "llmd-agent diagnostic: SIGTERM",
            "time: %s" % now_iso(),
            "job_id: %s  rank: %d  role: %s  host: %s  hostname: %s"
            % (
                self.job_id,
                self.rank,
                self.role.name,
                self.host_of(self.rank),
                socket.gethostname(),
            ),
            "state at SIGTERM: %s" % state_at_term,
            "agent pid: %d" % os.getpid(),
            "engine pid: %s  engine exit: %s"
            % (
                self.engine.pid if self.engine is not None else None,
                _rc_text(self.engine_rc) if self.engine_rc is not None else "running at TERM",
            ),
            "marker: %s" % (read_marker(self.log_dir, self.job_id) or "absent"),
            "",
            "processes in the engine/bench process groups at SIGTERM (pid pgid cmdline):",
        ]
        lines += ["  %d %d %s" % p for p in procs] or ["  (none)"]
        lines += ["", "needed SIGKILL after %gs:" % self.stop_timeout_s]
        lines += ["  " + k for k in killed] or ["  (none)"]
        if self.engine is not None:
            lines += ["", "last lines of %s:" % self.engine_log]
            lines += ["  " + ln for ln in tail_lines(self.engine_log)]
        path = os.path.join(self.job_dir, shared.diag_name(self.rank))
        try:
            write_atomic(path, ("\n".join(lines) + "\n").encode("utf-8"), durable=True)
            self.log("diag.written", path=path)
        except OSError as exc:
            self.log("diag.error", error=str(exc))

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
        # Spawn the engine before any other thread exists (see _child_preexec_for).
        try:
            self.start_engine()
        except LocalFailure as exc:
            self.start_error = exc
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        rc = shared.RC_INTERNAL
        try:
            try:
                rc = self.run_coordinator() if self.role.is_coordinator else self.run_worker()
            except Terminated:
                rc = self.handle_term()
        except Exception:
            self.log("internal_error", trace=traceback.format_exc())
            rc = shared.RC_INTERNAL
            if self.role.is_coordinator and not self.marker_published:
                with contextlib.suppress(Exception):
                    self.publish(rc, "agent internal error on rank %d" % self.rank)
            self.stop_group(self.bench, "bench")
            self.stop_group(self.engine, "engine")
        if self.term_received and not self.term_handled and self.final_rc is None:
            rc = self.handle_term()
        self.final_rc = rc
        # The rc is decided: a TERM from now on (srun --kill-on-bad-exit reacting to a peer
        # that exited first) must neither change it nor kill us by the default action --
        # which is what Python restores during interpreter shutdown. Measured: ranks that
        # had logged "exit rc=7" were reported "Terminated" and srun's rc became 143.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._stop_heartbeat.set()
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


class LocalFailure(Exception):
    """This rank failed with `rc`; `component` is what failed: "engine" (the default), or
    a service by its name ("sidecar", a router process), recorded in the status file."""

    def __init__(
        self, rc: int, reason: str, from_rank: Optional[int] = None, component: str = "engine"
    ) -> None:
        super().__init__(reason)
        self.rc = rc
        self.reason = reason
        self.from_rank = from_rank
        self.component = component


class _Silence(object):
    """Detects that a status file stopped changing, on the local monotonic clock."""

    def __init__(self, path: str, limit_s: float) -> None:
        self.path = path
        self.limit_s = limit_s
        self.last_seen: Optional[Tuple[float, int]] = None
        self.changed_at = time.monotonic()

    def expired(self) -> bool:
        try:
            st = os.stat(self.path)
            seen: Optional[Tuple[float, int]] = (st.st_mtime, st.st_ino)
        except OSError:
            seen = None
        if seen is not None and seen != self.last_seen:
            self.last_seen = seen
            self.changed_at = time.monotonic()
            state = (read_json(self.path) or {}).get("state")
            if state in shared.GONE_STATES:
                # The coordinator is gone for good; only the marker can still arrive.
                self.changed_at = -1e18
        return time.monotonic() - self.changed_at > self.limit_s


def _rc_text(rc: Optional[int]) -> str:
    if rc is None:
        return "unknown status"
    if rc < 0:
        try:
            return "signal %s" % signal.Signals(-rc).name
        except ValueError:
            return "signal %d" % -rc
    return "rc %d" % rc


def _shown(value: Any, limit: int = 80) -> str:
    """A value the job wrote, as JSON text of at most `limit` characters."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _float_or_zero(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def _load_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except Exception:  # not Linux/glibc: no parent-death signal, stop_group still reaps
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _child_preexec_for(parent: int, group: Optional[int] = None) -> Any:
    """A preexec_fn for engine/bench children of ``parent`` (the agent's pid).

    The child gets its own session and process group (or joins `group`, the engine's), and
    is SIGKILLed if the agent dies
    (a SIGKILLed agent cannot stop it otherwise). If the agent died between fork and
    prctl the signal would never come, so the child checks its parent and exits.

    preexec_fn is documented as unsafe once threads exist (the bench is spawned while the
    heartbeat thread runs): this only makes system calls (setsid, prctl through a ctypes
    function resolved at import, getppid), and glibc keeps malloc usable in the child.
    """

    def preexec() -> None:
        try:
            if group is None:
                raise OSError
            os.setpgid(0, group)  # a router or sidecar: stopped with its engine's group
        except OSError:
            os.setsid()
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os._exit(shared.RC_INTERNAL)

    return preexec


def load_config(path: str) -> Dict[str, Any]:
    cfg = read_json(path)
    if cfg is None:
        raise ConfigError("cannot read config %s" % path)
    if cfg.get("version") != shared.CONFIG_VERSION:
        raise ConfigError(
            "config %s has version %r; this agent knows only version %d (render the batch "
            "script with the llmd-supervisor that ships this agent)"
            % (path, cfg.get("version"), shared.CONFIG_VERSION)
        )
    for key in ("log_dir", "prefill_nodes", "decode_nodes", "engine", "bench", "grace_s"):
        if key not in cfg:
            raise ConfigError("config %s lacks %r" % (path, key))
    return cfg


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="llm-d node agent (one per node, under srun).")
    parser.add_argument(
        "--config", required=True, help="agent config JSON written by the batch script"
    )
    parser.add_argument(
        "--hosts",
        default=os.environ.get("LLMD_HOSTS", ""),
        help="comma-separated host per rank (default: expand SLURM_JOB_NODELIST)",
    )
    parser.add_argument("--rank", type=int, default=None, help="override SLURM_PROCID")
    parser.add_argument("--job-id", default=None, help="override SLURM_JOB_ID")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    signal.signal(signal.SIGTERM, _early_term)
    try:
        args = parse_args(argv)
        cfg = load_config(args.config)
        rank = args.rank if args.rank is not None else int(os.environ["SLURM_PROCID"])
        job_id = args.job_id or os.environ["SLURM_JOB_ID"]
        if not re.fullmatch(r"[0-9A-Za-z_.-]+", job_id):
            raise ConfigError("bad job id %r" % job_id)
        nnodes = int(cfg["prefill_nodes"]) + int(cfg["decode_nodes"])
        if args.hosts:
            hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        else:
            hosts = shared.expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
        if len(hosts) != nnodes:
            raise ConfigError("%d hosts %r for %d nodes (P+D)" % (len(hosts), hosts, nnodes))
        agent = Agent(cfg, rank, job_id, hosts)
    except (ConfigError, KeyError, ValueError) as exc:
        print("llmd-agent: configuration error: %s" % (exc,), file=sys.stderr, flush=True)
        return shared.RC_CONFIG
    signal.signal(signal.SIGTERM, agent.on_sigterm)
    if _EARLY_TERM:
        agent.term_received = True
    return agent.run()


_EARLY_TERM: List[int] = []


def _early_term(signum: int, frame: Any) -> None:
    _EARLY_TERM.append(signum)


if __name__ == "__main__":
    sys.exit(main())
