"""Supervises multi-node llm-d benchmark allocations on Slurm."""

import warnings

__version__ = "0.1.0"

# asyncssh (2.24.1, the newest) still names cryptography's DSA classes, which cryptography
# 51 deprecates: without this, importing it printed five warnings on every command's stderr.
warnings.filterwarnings("ignore", message="DSA is deprecated", module="asyncssh")
