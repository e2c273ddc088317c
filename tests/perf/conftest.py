"""tests/perf is a benchmark harness (`tests/perf/run.sh`), not a test suite: collect nothing."""

from __future__ import annotations

collect_ignore_glob = ["*.py"]
