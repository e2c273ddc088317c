"""Node-side code that runs inside the allocation (stdlib only, Python 3.9+).

The batch script rendered by :mod:`llmd_supervisor.core.render` embeds these files verbatim and
writes them to the run's log directory on the shared file system:

* ``agent.py`` -- the per-node agent (completion-marker protocol, DESIGN.md section 4);
* ``engine.py`` -- stand-in for a vLLM prefill/decode engine;
* ``bench.py`` -- stand-in benchmark client.

Each file is a standalone script: no imports between them and none from the package.
"""

NODE_FILES = ("agent.py", "engine.py", "bench.py")
