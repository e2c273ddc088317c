"""Run the node agent.

The batch script writes this file into the job's node directory as ``agent.py``, beside
the ``llmd_node`` package (a copy of ``llmd_supervisor/node``), and srun runs
``python3 <node dir>/agent.py --config <node dir>/config.json`` on every node. From an
installed package: ``python3 -m llmd_supervisor.node.agent --config ...``.
"""

import sys

if __package__:  # python3 -m llmd_supervisor.node.agent
    from .main import main
else:  # <node dir>/agent.py: that directory is sys.path[0], and holds llmd_node/
    from llmd_node.agent.main import main  # type: ignore[import-not-found,no-redef]

if __name__ == "__main__":
    sys.exit(main())
