"""Adapters: each owns one outside system and turns its errors into ours.

Slurm commands, SSH, the journal, the archive, the control transport, metrics and
systemd. Adapters import the core, never the orchestration (tests/unit/test_layers.py).
"""
