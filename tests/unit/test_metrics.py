"""Metrics: per-daemon registries, command instrumentation, and the exposition server."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmd_supervisor.adapters.metrics import (
    InstrumentedRunner,
    LinkCounts,
    Metrics,
    RunSample,
    serve_metrics,
    verify_seconds,
)
from llmd_supervisor.adapters.nodes.remote import NodeLink, SshSettings
from llmd_supervisor.adapters.slurm.runner import LocalRunner
from llmd_supervisor.adapters.slurm.ssh import SshRunner
from llmd_supervisor.core.run.lifecycle import RunState, Transition
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import ConfigError, SlurmCommandError


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def fetch(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.asyncio
async def test_instrumented_runner_records_latency_and_errors_by_command() -> None:
    m = Metrics()
    runner = InstrumentedRunner(LocalRunner(), m, "dev")
    assert (await runner.run(["true"], time_limit=5)).ok
    assert not (await runner.run(["false"], time_limit=5)).ok
    with pytest.raises(SlurmCommandError):
        await runner.run(["sleep", "5"], time_limit=0.2)
    # SSH to a login host that refuses connections: the command could not be started.
    link = NodeLink(
        "127.0.0.1",
        SshSettings("nobody", (), None, port=free_port(), insecure_accept_any_host_key=True),
    )
    remote = InstrumentedRunner(SshRunner(link, {"SLURM_CONF": "/x"}), m, "dev")
    with pytest.raises(SlurmCommandError) as info:
        await remote.run(["squeue"], time_limit=5)
    assert info.value.returncode is None and "127.0.0.1" in str(info.value)
    await link.aclose()
    s = samples(m.exposition().decode())
    p = "llmd_supervisor_slurm_command_"
    assert s[(p + "duration_seconds_count", (("cluster", "dev"), ("command", "true")))] == 1
    assert s[(p + "duration_seconds_count", (("cluster", "dev"), ("command", "sleep")))] == 1
    assert s[(p + "duration_seconds_sum", (("cluster", "dev"), ("command", "sleep")))] >= 0.2
    err = p + "errors_total"
    assert s[(err, (("cluster", "dev"), ("command", "false"), ("kind", "exit_status")))] == 1
    assert s[(err, (("cluster", "dev"), ("command", "sleep"), ("kind", "timeout")))] == 1
    assert s[(err, (("cluster", "dev"), ("command", "squeue"), ("kind", "unavailable")))] == 1
    assert (err, (("cluster", "dev"), ("command", "true"), ("kind", "exit_status"))) not in s


def test_two_daemons_have_separate_registries() -> None:
    a, b = Metrics(), Metrics()
    a.record_lag(0.25)
    assert samples(a.exposition().decode())[("llmd_supervisor_loop_lag_last_seconds", ())] == 0.25
    assert samples(b.exposition().decode())[("llmd_supervisor_loop_lag_last_seconds", ())] == 0
    s = samples(b.exposition().decode())
    assert s[("llmd_supervisor_runs", (("state", "running"),))] == 0  # every state, even empty
    assert s[("llmd_supervisor_ssh_connections_open", ())] == 0  # no links attached yet
    b.attach(list, lambda: LinkCounts(open=3, connects=5))
    s = samples(b.exposition().decode())
    assert s[("llmd_supervisor_ssh_connections_open", ())] == 3
    assert s[("llmd_supervisor_ssh_connects_total", ())] == 5
    assert samples(a.exposition().decode())[("llmd_supervisor_ssh_connections_open", ())] == 0


def test_verify_duration_is_verifying_to_the_next_transition() -> None:
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    ts = [
        Transition(RunState.RUNNING, t0, "Started"),
        Transition(RunState.FINISHING, t0 + timedelta(seconds=5), "LeftQueue"),
        Transition(RunState.VERIFYING, t0 + timedelta(seconds=7), "WatchersStopped"),
        Transition(RunState.ARCHIVING, t0 + timedelta(seconds=10.5), "Verified"),
        Transition(RunState.SUCCEEDED, t0 + timedelta(seconds=11), "Archived"),
    ]
    assert verify_seconds(ts) == 3.5
    assert verify_seconds(ts[:3]) is None  # still verifying


def test_runs_and_links_come_from_the_snapshots_the_daemon_attaches() -> None:
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    done = (
        Transition(RunState.VERIFYING, t0, "WatchersStopped"),
        Transition(RunState.ARCHIVING, t0 + timedelta(seconds=2), "Verified"),
        Transition(RunState.SUCCEEDED, t0 + timedelta(seconds=3), "Archived"),
    )
    runs = [
        RunSample("a", "dev", RunState.RUNNING, None, (), 100),
        RunSample("b", "dev", RunState.RUNNING, None, (), 20),
        RunSample("c", "other", RunState.SUCCEEDED, Outcome.SUCCEEDED, done, 5),
    ]
    links = LinkCounts(open=3, connects=4, reconnects=1, connect_failures=2)
    m = Metrics()
    m.attach(lambda: runs, lambda: links)
    s = samples(m.exposition().decode())
    assert s[("llmd_supervisor_runs", (("state", "running"),))] == 2
    assert s[("llmd_supervisor_runs", (("state", "succeeded"),))] == 1
    assert s[("llmd_supervisor_runs_by_outcome", (("outcome", "succeeded"),))] == 1
    assert s[("llmd_supervisor_tail_bytes_total", (("cluster", "dev"),))] == 120
    assert s[("llmd_supervisor_tail_bytes_total", (("cluster", "other"),))] == 5
    assert s[("llmd_supervisor_ssh_connections_open", ())] == 3
    assert s[("llmd_supervisor_ssh_connects_total", ())] == 4
    assert s[("llmd_supervisor_ssh_reconnects_total", ())] == 1
    assert s[("llmd_supervisor_ssh_connect_failures_total", ())] == 2
    # "c" was final when attached: not observed. A run that ends afterwards is, once.
    count = ("llmd_supervisor_verify_duration_seconds_count", (("outcome", "succeeded"),))
    assert s.get(count, 0) == 0
    runs[0] = RunSample("a", "dev", RunState.SUCCEEDED, Outcome.SUCCEEDED, done, 100)
    m.observe_verdicts()
    s = samples(m.exposition().decode())
    assert s[count] == 1
    assert s[("llmd_supervisor_verify_duration_seconds_sum", (("outcome", "succeeded"),))] == 2


def test_gpu_hours_of_ended_attempts_are_counted_once_by_outcome_and_cause() -> None:
    failed = {"outcome": "node_failed", "cause": "infrastructure", "gpu_hours": 12.0}
    done = {"outcome": "succeeded", "cause": None, "gpu_hours": 24.0}
    runs = [RunSample("a", "dev", RunState.ACCEPTED, None, (), 0, (failed,))]
    m = Metrics()
    m.attach(lambda: [], LinkCounts)  # nothing had ended when the daemon started
    m.runs = lambda: runs
    m.observe_verdicts()
    runs[0] = RunSample("a", "dev", RunState.SUCCEEDED, Outcome.SUCCEEDED, (), 0, (failed, done))
    s = samples(m.exposition().decode())
    lost = ("cause", "infrastructure"), ("cluster", "dev"), ("outcome", "node_failed")
    useful = ("cause", "none"), ("cluster", "dev"), ("outcome", "succeeded")
    assert s[("llmd_supervisor_gpu_hours_total", lost)] == 12.0  # once, though seen twice
    assert s[("llmd_supervisor_gpu_hours_total", useful)] == 24.0


@pytest.mark.asyncio
async def test_exposition_server_serves_metrics_on_loopback_and_404_elsewhere() -> None:
    m = Metrics()
    m.record_lag(0.01)
    port = free_port()
    async with anyio.create_task_group() as tg:
        bound = await tg.start(serve_metrics, m, f"127.0.0.1:{port}")
        assert bound == port
        status, ctype, body = await anyio.to_thread.run_sync(
            fetch, f"http://127.0.0.1:{port}/metrics"
        )
        assert status == 200 and ctype.startswith("text/plain")
        s = samples(body)
        assert s[("llmd_supervisor_loop_lag_seconds_count", ())] == 1
        assert ("llmd_supervisor_build_info", (("version", "0.1.0"),)) in s
        status, _, _ = await anyio.to_thread.run_sync(fetch, f"http://127.0.0.1:{port}/nope")
        assert status == 404
        # A client that connects and says nothing does not block the next scrape.
        idle = await anyio.connect_tcp("127.0.0.1", port)
        status, _, _ = await anyio.to_thread.run_sync(fetch, f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        await idle.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_taken_port_is_a_config_error_naming_metrics_listen() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            await serve_metrics(Metrics(), f"127.0.0.1:{port}")
    assert info.value.key == "metrics.listen"
