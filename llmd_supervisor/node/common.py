"""Names the node agent and the daemon must agree on; stdlib only, Python 3.9+.

The batch script writes this file into the job's node directory as
``llmd_node/common.py`` (see :mod:`llmd_supervisor.node`), where the agent's package imports
it relatively; the daemon imports it as ``llmd_supervisor.node.common``. Of the node side the
daemon imports only this module and ``marker_format`` (the one marker reader).

Files of one job, under the run's log directory ``L`` and job id ``J``:
  * ``L/.bench_done.J``               -- the completion marker (``marker_name``)
  * ``L/J/``                          -- the job directory (``job_dir``)
  * ``L/J/rank<r>.status.json``       -- a rank's heartbeat (``status_name``)
  * ``L/J/rank<r>.*``                 -- a rank's logs (``is_rank_log``)
  * ``L/J/node/``                     -- the node scripts and the agent's config
  * ``L/J/bench/``                    -- the benchmark points' results and logs
"""

import re
from typing import List

# Version of the agent's JSON config; the agent refuses any other.
CONFIG_VERSION = 1

# The agent's defaults, in one place: the renderer (``core.render.agent_config``) writes
# them into every config, and the agent (``agent.config.load_config``) assumes them for a
# key its config lacks.
HEARTBEAT_S = 2.0  # how often a rank rewrites its status file
MARKER_GRACE_S = 10.0  # how long a worker waits for a late marker
COORDINATOR_SILENCE_S = 60.0  # a worker gives up on a coordinator silent this long
CONNECT_TIMEOUT_S = 2.0  # every health check: TCP connect ...
READ_TIMEOUT_S = 2.0  # ... and the answer
AGENT_DEFAULTS = {
    "heartbeat_s": HEARTBEAT_S,
    "marker_grace_s": MARKER_GRACE_S,
    "coordinator_silence_s": COORDINATOR_SILENCE_S,
    "gpus_per_node": 0,
    "standins": False,  # load the stand-ins' fault hooks (``faults.py`` beside the agent)
}
ENGINE_DEFAULTS = {
    "port_stride": 0,
    "health_path": "/health",
    "health_timeout_s": 600.0,
    "connect_timeout_s": CONNECT_TIMEOUT_S,
    "read_timeout_s": READ_TIMEOUT_S,
}
BENCH_DEFAULTS = {"point_timeout_s": 3600.0}
HEALTH_SCOPE_DEFAULT = "all"  # which ranks of a role answer health checks


def stop_timeout_s(grace_s: float) -> float:
    """How long the agent waits for its engine after TERM before SIGKILL: room is left
    inside the grace for the SIGKILL, the diagnostic and the exit."""
    return max(0.5, min(grace_s - 2.0, grace_s * 0.75))


def exit_linger_s(stop_s: float) -> float:
    """How long a failed coordinator waits for the workers to exit before it does."""
    return stop_s + 5.0


MARKER_PREFIX = ".bench_done."
STATUS_SUFFIX = ".status.json"
NODE_DIR = "node"
# The router's endpoints (EPP file discovery), in the job directory.
ENDPOINTS_FILE = "endpoints.yaml"

# Exit codes of the agent (and so of srun and the job), beside the marker's own rc.
RC_OK = 0
RC_CONFIG = 64
# (the batch shell, before any agent) the node files' archive in the batch script does
# not match its sha256, or base64 could not decode it: nothing was unpacked or started
RC_NODE_FILES = 65
RC_INTERNAL = 70
RC_ENGINE_START = 71
RC_ENGINE_UNHEALTHY = 72
RC_ENGINE_DIED = 73
RC_REMOTE_UNHEALTHY = 74
RC_COORDINATOR_SILENT = 75
RC_SERVICE_UNHEALTHY = 76  # a router or sidecar process not healthy within its deadline
RC_SERVICE_DIED = 77  # a router or sidecar process exited
RC_BAD_MARKER = 78  # (worker) the job's marker holds an rc that is no exit status
RC_PORT_IN_USE = 79  # an engine, router or sidecar could not bind its port: already in use
RC_SIGTERM = 143
LOCAL_FAILURE_RCS = (RC_ENGINE_START, RC_ENGINE_UNHEALTHY, RC_ENGINE_DIED)

# The ``state`` values of a status file, in the order an agent goes through them.
STATE_STARTING = "starting"
STATE_WAITING_HEALTH = "waiting_health"
STATE_READY = "ready"
STATE_WAITING_ENGINES = "waiting_engines"
STATE_BENCHMARKING = "benchmarking"
STATE_PUBLISHING = "publishing"
STATE_STOPPING = "stopping"
STATE_ENGINE_DIED = "engine_died"
STATE_FAILED = "failed"
STATE_TERMINATING = "terminating"
STATE_TERMINATED = "terminated"
STATE_EXITED = "exited"
AGENT_STATES = (
    STATE_STARTING,
    STATE_WAITING_HEALTH,
    STATE_READY,
    STATE_WAITING_ENGINES,
    STATE_BENCHMARKING,
    STATE_PUBLISHING,
    STATE_STOPPING,
    STATE_ENGINE_DIED,
    STATE_FAILED,
    STATE_TERMINATING,
    STATE_TERMINATED,
    STATE_EXITED,
)
GONE_STATES = (STATE_EXITED, STATE_TERMINATED)


def marker_name(job_id: str) -> str:
    """The completion marker's file name in the run's log directory."""
    return MARKER_PREFIX + job_id


def status_name(rank: int) -> str:
    """A rank's heartbeat file name in the job directory."""
    return "rank%d%s" % (rank, STATUS_SUFFIX)


def diag_name(rank: int) -> str:
    """A rank's diagnostic (written on SIGTERM) in the job directory."""
    return "rank%d.diag.txt" % rank


BENCH_DIR = "bench"  # in the job directory: one result and one log per benchmark point


def result_name(concurrency: int) -> str:
    """A benchmark point's result file name in the bench directory."""
    return "c%d.json" % concurrency


def bench_log_name(concurrency: int) -> str:
    """A benchmark point's client log file name in the bench directory."""
    return "c%d.log" % concurrency


def rank_prefix(rank: int) -> str:
    return "rank%d." % rank


def is_rank_log(name: str, rank: int) -> bool:
    """Whether ``name`` in the job directory is one of ``rank``'s logs (not its status)."""
    return name.startswith(rank_prefix(rank)) and not name.endswith(STATUS_SUFFIX)


def expand_hostlist(expr: str) -> List[str]:
    """Expand a Slurm hostlist such as ``node[1-3,05],gpu-a[01-02]x`` into host names.

    Zero padding of a range is kept (``n[08-10]`` -> n08 n09 n10). Several bracket groups
    in one name are expanded as a cartesian product, as Slurm does. Raises ValueError for
    a malformed list.
    """
    hosts: List[str] = []
    for item in _split_top_level(expr.strip()):
        if item:
            hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(expr: str) -> List[str]:
    parts: List[str] = []
    depth = 0
    current: List[str] = []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced ']' in hostlist %r" % expr)
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError("unbalanced '[' in hostlist %r" % expr)
    parts.append("".join(current))
    return parts


def _expand_one(item: str) -> List[str]:
    start = item.find("[")
    if start < 0:
        if "]" in item:
            raise ValueError("unbalanced ']' in hostlist item %r" % item)
        return [item]
    end = item.find("]", start)
    if end < 0:
        raise ValueError("unbalanced '[' in hostlist item %r" % item)
    prefix, body, rest = item[:start], item[start + 1 : end], item[end + 1 :]
    if "[" in body:
        raise ValueError("nested brackets in hostlist item %r" % item)
    values: List[str] = []
    for rng in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", rng.strip())
        if m is None:
            raise ValueError("bad range %r in hostlist item %r" % (rng, item))
        lo_s, hi_s = m.group(1), m.group(2)
        if hi_s is None:
            values.append(lo_s)
            continue
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ValueError("descending range %r in hostlist item %r" % (rng, item))
        if hi - lo > 100000:
            raise ValueError("range %r in hostlist item %r is too large" % (rng, item))
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        values.extend(str(v).zfill(width) for v in range(lo, hi + 1))
    return [prefix + v + tail for v in values for tail in _expand_one(rest)]
