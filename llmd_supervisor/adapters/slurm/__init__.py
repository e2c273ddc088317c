"""Slurm's client commands run with timeouts, here or on a remote login node.
May import: `core`, other adapters and `errors`; never `supervision` or `cli`.
"""
