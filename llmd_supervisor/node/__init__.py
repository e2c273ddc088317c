"""Node-side code that runs inside the allocation (stdlib only, Python 3.9+).

The batch script rendered by :mod:`llmd_supervisor.core.render.script` carries the agent's files
unchanged, in one gzip'd tar listed file by file in its comments, and unpacks them into
the run's job directory on the shared file system, ``<log_dir>/<job_id>/node/``
(`AGENT_FILES`: where each goes there, and which file of this package it is):

* ``agent.py`` -- the launcher srun runs (``agent/__main__.py``);
* ``llmd_node/`` -- this package as the agent imports it there: ``common.py`` (the names
  the agent and the daemon agree on: file names, states, rc codes, the agent's defaults,
  hostlist expansion), ``marker_format.py`` (the one reader of the completion marker, the
  daemon's too) and ``agent/`` (the per-node agent, DESIGN.md section 4, in modules by
  responsibility; it imports ``common`` and ``marker_format`` relatively and nothing else
  outside the standard library).

The stand-ins (:mod:`llmd_supervisor.standins`, `STANDIN_FILES`) are written beside
``agent.py`` only when the spec opts in (``[standins] enabled = true``).

``safe_read.py`` is not part of the batch script: the daemon runs it (``python3 -I -S -c``)
on the nodes, login hosts and its own machine to read a job's files without following
links (see :mod:`llmd_supervisor.adapters.nodes.jobfiles`).
"""

# The package name the agent's package has in the node directory.
NODE_PACKAGE = "llmd_node"
_AGENT_MODULES = (
    "__init__",
    "bringup",
    "config",
    "errors",
    "files",
    "health",
    "hooks",
    "main",
    "marker",
    "processes",
    "run",
    "status",
    "stop",
    "sweep",
    "templates",
    "topology",
    "view",
)
# Path in the node directory -> path of the source below ``llmd_supervisor/``.
AGENT_FILES = dict(
    [
        ("agent.py", "node/agent/__main__.py"),
        (NODE_PACKAGE + "/__init__.py", "node/__init__.py"),
        (NODE_PACKAGE + "/common.py", "node/common.py"),
        (NODE_PACKAGE + "/marker_format.py", "node/marker_format.py"),
    ]
    + [(NODE_PACKAGE + "/agent/%s.py" % m, "node/agent/%s.py" % m) for m in _AGENT_MODULES]
)
# The stand-in scripts a spec's commands may run as ``{node_dir}/<name>``.
STANDIN_SCRIPTS = ("engine.py", "bench.py", "router.py", "sidecar.py")
STANDIN_FILES = dict(
    [("faults.py", "standins/faults.py")] + [(n, "standins/" + n) for n in STANDIN_SCRIPTS]
)
# Every file a batch script may carry (the agent's, then the stand-ins').
NODE_FILES = dict(list(AGENT_FILES.items()) + list(STANDIN_FILES.items()))
