"""Supervises multi-node llm-d benchmark allocations on Slurm."""

__version__ = "0.1.0"
