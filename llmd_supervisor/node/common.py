"""Names the node agent and the daemon must agree on; stdlib only, Python 3.9+.

The batch script writes this file beside ``agent.py`` in the job's node directory, so the
agent imports it as a plain module; the daemon imports it as
``llmd_supervisor.node.common``. Nothing else of the node side is imported by the daemon.

Files of one job, under the run's log directory ``L`` and job id ``J``:
  * ``L/.bench_done.J``               -- the completion marker (``marker_name``)
  * ``L/J/``                          -- the job directory (``job_dir``)
  * ``L/J/rank<r>.status.json``       -- a rank's heartbeat (``status_name``)
  * ``L/J/rank<r>.*``                 -- a rank's logs (``is_rank_log``)
  * ``L/J/node/``                     -- the node scripts and the agent's config
  * ``L/J/bench/``                    -- the benchmark points' results and logs
"""

import os
import re
import sys
import threading
from typing import Dict, List, Optional

# Version of the agent's JSON config; the agent refuses any other.
CONFIG_VERSION = 1

MARKER_PREFIX = ".bench_done."
STATUS_SUFFIX = ".status.json"
NODE_DIR = "node"
# The router's endpoints (EPP file discovery), in the job directory.
ENDPOINTS_FILE = "endpoints.yaml"

# Exit codes of the agent (and so of srun and the job), beside the marker's own rc.
RC_OK = 0
RC_CONFIG = 64
RC_INTERNAL = 70
RC_ENGINE_START = 71
RC_ENGINE_UNHEALTHY = 72
RC_ENGINE_DIED = 73
RC_REMOTE_UNHEALTHY = 74
RC_COORDINATOR_SILENT = 75
RC_SERVICE_UNHEALTHY = 76  # a router or sidecar process not healthy within its deadline
RC_SERVICE_DIED = 77  # a router or sidecar process exited
RC_BAD_MARKER = 78  # (worker) the job's marker holds an rc that is no exit status
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


_SAY = threading.Lock()


def say(line: str) -> None:
    """Write one whole line to stdout and flush it. ``print`` writes the text and its
    newline in two calls, so the request threads of a stand-in server could merge two
    access lines into one under load."""
    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def marker_name(job_id: str) -> str:
    """The completion marker's file name in the run's log directory."""
    return MARKER_PREFIX + job_id


def marker_rc(value: object) -> Optional[int]:
    """A marker's ``rc`` as the exit status it stands for: an ``int`` (a ``bool`` is not
    one) from 0 to 255, else None. ``exit(256)`` and ``exit(False)`` both exit 0, so any
    other value would pass a failure off as a success. The daemon's marker reader
    (`core.marker`) and the node agent read rc through this one function."""
    if type(value) is not int or not 0 <= value <= 255:
        return None
    return value


def status_name(rank: int) -> str:
    """A rank's heartbeat file name in the job directory."""
    return "rank%d%s" % (rank, STATUS_SUFFIX)


def fault(name: str, extra: Optional[Dict[str, str]] = None) -> str:
    """A stand-in's fault knob from the environment (over `extra`, e.g. the spec's
    ``env.common`` as the agent sees it): its value, or "" when unset, when
    ``LLMD_FAKE_FAULT_RANKS`` is set and does not list this rank (``LLMD_RANK``), or when
    ``LLMD_FAKE_FAULT_NODES`` is set and does not list this host (a node's fault follows
    the node into every job, as a bad node's would)."""
    import socket  # here: the supervisor's pure core imports this module's names

    env = dict(extra or {})
    env.update(os.environ)
    for knob, mine in (
        ("LLMD_FAKE_FAULT_RANKS", env.get("LLMD_RANK", "")),
        ("LLMD_FAKE_FAULT_NODES", socket.gethostname()),
    ):
        listed = env.get(knob, "").strip()
        if listed and mine not in [r.strip() for r in listed.split(",")]:
            return ""
    return str(env.get(name, ""))


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
