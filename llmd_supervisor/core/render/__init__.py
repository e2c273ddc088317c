"""A run spec rendered into a self-contained sbatch script (pure): the script, the node
agent's config, and the node files as one deterministic archive without their prose. May
import: pure core and the node package's names; no I/O.
"""
