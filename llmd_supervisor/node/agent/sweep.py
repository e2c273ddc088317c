"""The benchmark sweep on the coordinator: one client run per concurrency point, each a
stage with its own deadline; any failed point makes the run's rc nonzero."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, List, Optional, Tuple

from .. import common as shared
from . import bringup, processes
from .errors import LocalFailure
from .processes import rc_text
from .stop import POLL_S
from .templates import expand_template
from .topology import leader_ranks

if TYPE_CHECKING:
    from .view import AgentView


def run_sweep(agent: "AgentView", router_url: Optional[str] = None) -> Tuple[int, str]:
    """Every benchmark point in turn (each is run even after one failed); the run's rc
    (the first failed point's, 0 when all passed) and its reason."""
    bench = agent.cfg["bench"]
    bench_dir = os.path.join(agent.job_dir, shared.BENCH_DIR)
    os.makedirs(bench_dir, exist_ok=True)
    prefill = [
        "http://%s:%d" % (agent.host_of(r), agent.port_of(r))
        for r in leader_ranks(agent.cfg, "prefill")
    ]
    decode = [
        "http://%s:%d" % (agent.host_of(r), agent.port_of(r))
        for r in leader_ranks(agent.cfg, "decode")
    ]
    final_rc = 0
    failures: List[str] = []
    points = [int(c) for c in bench["concurrencies"]]
    for i, conc in enumerate(points):
        # What `status` shows while the sweep runs.
        agent.set_state(
            shared.STATE_BENCHMARKING, "concurrency %d (%d of %d)" % (conc, i + 1, len(points))
        )
        values = agent.template_values()
        values.update(
            {
                "concurrency": str(conc),
                "num_prompts": str(conc * int(bench["prompts_multiplier"])),
                "input_len": str(bench["input_len"]),
                "output_len": str(bench["output_len"]),
                "request_rate": str(bench["request_rate"]),
                "prefill_urls": ",".join(prefill),
                "decode_urls": ",".join(decode),
                "result_file": os.path.join(bench_dir, shared.result_name(conc)),
                "router_url": router_url or "",
            }
        )
        argv = [expand_template(a, values) for a in bench["command"]]
        log_path = os.path.join(bench_dir, shared.bench_log_name(conc))
        timeout = float(bench["point_timeout_s"])
        agent.stage("benchmark c=%d" % conc, timeout)
        rc = run_bench_point(agent, conc, argv, log_path)
        failed = None if rc == 0 else "concurrency %d exited %s" % (conc, rc_text(rc))
        agent.stage_end(failed, diagnose=rc == 124)  # 124: over its deadline
        if rc != 0:
            failures.append("concurrency %d exited %s" % (conc, rc_text(rc)))
            if final_rc == 0:
                final_rc = rc if 0 < rc < 256 else 1
    if failures:
        return final_rc, "benchmark failed: " + "; ".join(failures)
    return 0, "ok: %d benchmark points passed" % len(bench["concurrencies"])


def run_bench_point(agent: "AgentView", conc: int, argv: List[str], log_path: str) -> int:
    """Run one point's client to its end; its rc (124: over its deadline, then stopped;
    127: could not start). LocalFailure when the engine, a service or another rank fails
    meanwhile."""
    timeout = float(agent.cfg["bench"]["point_timeout_s"])
    agent.log("bench.start", concurrency=conc, argv=" ".join(argv))
    try:
        agent.bench = processes.spawn(argv, log_path, agent.role_env("bench"), agent.job_dir)
    except OSError as exc:
        agent.log("bench.error", concurrency=conc, error=str(exc))
        return 127
    deadline = time.monotonic() + timeout
    try:
        while True:
            rc = agent.bench.poll()
            if rc is not None:
                agent.log("bench.done", concurrency=conc, rc=rc)
                return rc if rc >= 0 else 128 - rc
            erc = agent.poll_engine()
            if erc is not None:
                raise LocalFailure(
                    shared.RC_ENGINE_DIED,
                    "engine exited with %s during the benchmark" % rc_text(erc),
                )
            agent.raise_if_others_failed()
            bringup.check_services(agent)
            if time.monotonic() >= deadline:
                agent.log("bench.timeout", concurrency=conc, timeout_s=timeout)
                agent.stop_group(agent.bench, "bench")
                return 124
            agent.sleep(POLL_S)
    finally:
        # On SIGTERM, handle_term stops the bench after publishing the marker.
        if agent.bench.poll() is None and not agent.term.received:
            agent.stop_group(agent.bench, "bench")
