"""Orchestration: the shared pollers, per-run supervision, the verify loop and the daemon root."""
