"""Prometheus metrics: one registry per daemon, served on a loopback address.

What an operator gets (all prefixed ``llmd_supervisor_``):

- ``runs{state}`` and ``runs_by_outcome{outcome}``: the runs this daemon knows (the
  journal's, finished ones included), read at scrape time;
- ``slurm_command_duration_seconds{cluster,command}`` (histogram) and
  ``slurm_command_errors_total{cluster,command,kind}`` with kind ``exit_status`` (the
  command ran and failed), ``timeout`` or ``unavailable`` (could not be started / SSH to
  the login node failed), from `InstrumentedRunner`;
- ``ssh_connections_open``, ``ssh_connects_total``, ``ssh_reconnects_total``,
  ``ssh_connect_failures_total`` from the SSH link counters (node and login links);
- ``tail_bytes_total{cluster}``: log bytes copied into the local copies since the daemon
  started (by the tailers, or from the shared log directory at a run's end);
- ``verify_duration_seconds{outcome}``: time from `verifying` to the verdict, for runs
  that reached their verdict while this daemon ran;
- ``loop_lag_seconds`` (histogram) and ``loop_lag_last_seconds``: how late the event
  loop resumed the watchdog task;
- ``event_deliveries{destination,status}``: the outbox's deliveries per destination by
  status (queued, retrying, delivered, dead, disabled), as the event sender last counted
  them (every few seconds; none without a configured destination);
- ``build_info{version}``.

The daemon root hands `Metrics.attach` two snapshot functions, one for the runs
(`RunSample` each) and one for the SSH link counters (`LinkCounts`): this module knows
nothing of the supervisor. The exposition is prometheus-client's ASGI app, served by
uvicorn on the event loop (`serve_metrics`, `adapters.web.server`), so the snapshots are
taken without locks, and a blocked loop shows up as a failed scrape too.
"""

from __future__ import annotations

import functools
import os
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from llmd_supervisor import __version__
from llmd_supervisor.adapters.slurm.runner import CommandResult, CommandRunner
from llmd_supervisor.adapters.web.server import bind_tcp, parse_listen, serve_asgi
from llmd_supervisor.core.run.lifecycle import RunState, Transition
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import SlurmCommandError

log = structlog.get_logger("llmd_supervisor.adapters.metrics")

_P = "llmd_supervisor_"
_SLURM_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_VERIFY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)


@dataclass(frozen=True)
class RunSample:
    """What the metrics read of one run."""

    run_id: str
    cluster: str
    state: RunState
    outcome: Outcome | None
    transitions: Sequence[Transition]
    tail_bytes: int  # log bytes copied for it since the daemon started
    attempts: Sequence[Mapping[str, object]] = ()  # its ended attempts (`attempt.ended`)


@dataclass(frozen=True)
class LinkCounts:
    """The SSH links' counters, over every node and login-node link of the daemon."""

    open: int = 0  # connections held now
    connects: int = 0  # first connections of a link
    reconnects: int = 0  # connections re-established after a drop
    connect_failures: int = 0


def _no_runs() -> list[RunSample]:
    return []


class Metrics:
    """Every metric of one daemon, in its own `CollectorRegistry` (never the global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.slurm_seconds = Histogram(
            _P + "slurm_command_duration_seconds",
            "Wall time of Slurm client commands (and other commands run where Slurm runs).",
            ["cluster", "command"],
            buckets=_SLURM_BUCKETS,
            registry=r,
        )
        self.slurm_errors = Counter(
            _P + "slurm_command_errors",
            "Slurm commands that failed: exit_status, timeout or unavailable.",
            ["cluster", "command", "kind"],
            registry=r,
        )
        self.verify_seconds = Histogram(
            _P + "verify_duration_seconds",
            "Time from entering `verifying` to the verdict, by outcome.",
            ["outcome"],
            buckets=_VERIFY_BUCKETS,
            registry=r,
        )
        self.gpu_hours = Counter(
            _P + "gpu_hours",
            "GPU-hours of ended attempts, by outcome and cause (cause none: succeeded).",
            ["cluster", "outcome", "cause"],
            registry=r,
        )
        self.loop_lag = Histogram(
            _P + "loop_lag_seconds",
            "How much later than asked the event loop resumed the watchdog task.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.loop_lag_last = Gauge(
            _P + "loop_lag_last_seconds", "The latest event-loop lag measurement.", registry=r
        )
        Gauge(_P + "build_info", "The running version.", ["version"], registry=r).labels(
            __version__
        ).set(1)
        self.runs: Callable[[], Iterable[RunSample]] = _no_runs
        self.links: Callable[[], LinkCounts] = LinkCounts
        self.deliveries: Callable[[], Mapping[tuple[str, str], int]] = dict
        self._verdicts_seen: set[str] = set()
        self._attempts_seen: set[tuple[str, int]] = set()
        r.register(_StateCollector(self))

    def attach(
        self, runs: Callable[[], Iterable[RunSample]], links: Callable[[], LinkCounts]
    ) -> None:
        """Read the runs and link counters from these snapshots from now on; runs already
        final are not observed again."""
        self.runs, self.links = runs, links
        self._verdicts_seen = {r.run_id for r in runs() if r.state.is_final}
        self._attempts_seen = {key for r in runs() for key in _attempt_keys(r)}

    def attach_deliveries(self, deliveries: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        """Read the deliveries per (destination, status) from this snapshot from now on."""
        self.deliveries = deliveries

    def record_lag(self, lag_s: float) -> None:
        self.loop_lag.observe(lag_s)
        self.loop_lag_last.set(lag_s)

    def observe_verdicts(self, runs: Iterable[RunSample] | None = None) -> None:
        """Observe verify durations of runs that reached a final state, and the GPU-hours
        of attempts that ended, since the last call; of `runs` (those that changed since
        then, as the daemon knows them), or of every run."""
        for run in self.runs() if runs is None else runs:
            for key, attempt in zip(_attempt_keys(run), run.attempts, strict=True):
                if key in self._attempts_seen:
                    continue
                self._attempts_seen.add(key)
                hours = attempt.get("gpu_hours")
                if isinstance(hours, int | float) and not isinstance(hours, bool):
                    outcome, cause = str(attempt.get("outcome")), attempt.get("cause")
                    self.gpu_hours.labels(run.cluster, outcome, str(cause or "none")).inc(hours)
            if not run.state.is_final or run.run_id in self._verdicts_seen:
                continue
            self._verdicts_seen.add(run.run_id)
            seconds = verify_seconds(run.transitions)
            if seconds is not None:
                self.verify_seconds.labels(run.outcome.value if run.outcome else "").observe(
                    seconds
                )

    def exposition(self) -> bytes:
        self.observe_verdicts()
        return generate_latest(self.registry)


def _attempt_keys(run: RunSample) -> list[tuple[str, int]]:
    return [(run.run_id, i) for i in range(len(run.attempts))]


def verify_seconds(transitions: Sequence[Transition]) -> float | None:
    """Seconds between the last entry into `verifying` and the transition after it."""
    for i in range(len(transitions) - 2, -1, -1):
        if transitions[i].state is RunState.VERIFYING:
            return max(0.0, (transitions[i + 1].at - transitions[i].at).total_seconds())
    return None


class _StateCollector(Collector):
    """Scrape-time view of the runs and the SSH links."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked: the families below are built per scrape

    def collect(self) -> Iterable[Metric]:
        runs = list(self.metrics.runs())
        by_state = Tally(r.state.value for r in runs)
        states = GaugeMetricFamily(
            _P + "runs", "Runs this daemon knows, by state.", labels=["state"]
        )
        for state in RunState:
            states.add_metric([state.value], by_state.get(state.value, 0))
        yield states
        by_outcome = Tally(r.outcome.value for r in runs if r.outcome is not None)
        outcomes = GaugeMetricFamily(
            _P + "runs_by_outcome",
            "Runs with a verdict (archiving or final), by outcome.",
            labels=["outcome"],
        )
        for outcome in Outcome:
            if outcome is not Outcome.PENDING_EVIDENCE:
                outcomes.add_metric([outcome.value], by_outcome.get(outcome.value, 0))
        yield outcomes
        tail = CounterMetricFamily(
            _P + "tail_bytes",
            "Log bytes copied from the nodes into local copies since the daemon started.",
            labels=["cluster"],
        )
        per_cluster: Tally[str] = Tally()
        for r in runs:
            per_cluster[r.cluster] += r.tail_bytes
        for cluster, n in sorted(per_cluster.items()):
            tail.add_metric([cluster], n)
        yield tail
        s = self.metrics.links()
        yield GaugeMetricFamily(
            _P + "ssh_connections_open",
            "SSH connections held now (node and login-node links).",
            value=s.open,
        )
        yield CounterMetricFamily(
            _P + "ssh_connects", "SSH connections established (first connects).", value=s.connects
        )
        yield CounterMetricFamily(
            _P + "ssh_reconnects",
            "SSH connections re-established after a drop.",
            value=s.reconnects,
        )
        yield CounterMetricFamily(
            _P + "ssh_connect_failures", "Failed SSH connect attempts.", value=s.connect_failures
        )
        deliveries = GaugeMetricFamily(
            _P + "event_deliveries",
            "Outbound event deliveries per destination, by status.",
            labels=["destination", "status"],
        )
        for (destination, status), n in sorted(self.metrics.deliveries().items()):
            deliveries.add_metric([destination, status], n)
        yield deliveries


class InstrumentedRunner:
    """A `CommandRunner` that records latency and errors of every command it runs."""

    def __init__(self, inner: CommandRunner, metrics: Metrics, cluster: str) -> None:
        self.inner = inner
        self.metrics = metrics
        self.cluster = cluster

    async def run(
        self,
        argv: Sequence[str],
        *,
        time_limit: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        command = os.path.basename(argv[0]) if argv else ""
        t0 = time.monotonic()
        try:
            result = await self.inner.run(argv, time_limit=time_limit, stdin=stdin, env=env)
        except SlurmCommandError as exc:
            kind = "timeout" if exc.timed_out_after is not None else "unavailable"
            self.metrics.slurm_errors.labels(self.cluster, command, kind).inc()
            self.metrics.slurm_seconds.labels(self.cluster, command).observe(time.monotonic() - t0)
            raise
        self.metrics.slurm_seconds.labels(self.cluster, command).observe(time.monotonic() - t0)
        if not result.ok:
            self.metrics.slurm_errors.labels(self.cluster, command, "exit_status").inc()
        return result


def metrics_app(metrics: Metrics) -> Starlette:
    """The exposition as an ASGI app: prometheus-client's own, on ``/metrics`` and ``/``
    (GET and HEAD; anything else 404 or 405)."""
    exposition = make_asgi_app(registry=metrics.registry)

    async def scrape(scope: Scope, receive: Receive, send: Send) -> None:
        metrics.observe_verdicts()
        await exposition(scope, receive, send)

    endpoint = _GetOnly(scrape)
    return Starlette(routes=[Route("/metrics", endpoint), Route("/", endpoint)])


class _GetOnly:
    """An ASGI endpoint that answers GET and HEAD only."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            await PlainTextResponse(
                "method not allowed\n", status_code=405, headers={"Allow": "GET, HEAD"}
            )(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def serve_metrics(
    metrics: Metrics,
    listen: str,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` on `listen` until cancelled; report the bound port when listening.

    Raises `ConfigError` naming ``metrics.listen`` when the address cannot be bound. Served
    by uvicorn on the daemon's loop (`web_server.serve_asgi`): idle connections are closed
    after a few seconds, and a client that sends nothing blocks no other scrape.
    """
    sock = bind_tcp(listen, "metrics.listen")
    bound = int(sock.getsockname()[1])
    log.info("metrics.listening", host=parse_listen(listen)[0], port=bound)

    async with anyio.create_task_group() as tg:
        await tg.start(functools.partial(serve_asgi, metrics_app(metrics), [sock], name="metrics"))
        task_status.started(bound)
