"""Node-side code that runs inside the allocation (stdlib only, Python 3.9+).

The batch script rendered by :mod:`llmd_supervisor.core.render` embeds these files verbatim
and writes them to the run's job directory on the shared file system:

* ``common.py`` -- the names the agent and the daemon agree on (file names, states, rc
  codes, hostlist expansion); the only node module the daemon imports;
* ``agent.py`` -- the per-node agent (completion-marker protocol, DESIGN.md section 4);
  it imports ``common`` and nothing else outside the standard library;
* ``engine.py`` -- stand-in for a vLLM prefill/decode engine;
* ``bench.py`` -- stand-in benchmark client;
* ``router.py`` -- stand-in for the llm-d router (Envoy + EPP with file discovery) on the
  coordinator;
* ``sidecar.py`` -- stand-in for llm-d's P/D sidecar in front of each decode engine.

``jobfile.py`` is not part of the batch script: the daemon runs it (``python3 -I -S -c``)
on the nodes, login hosts and its own machine to read a job's files without following
links (see :mod:`llmd_supervisor.adapters.jobfiles`).
"""

NODE_FILES = ("common.py", "agent.py", "engine.py", "bench.py", "router.py", "sidecar.py")
