"""The llm-d run spec: TOML in, validated frozen dataclasses out (pure, no I/O).

Every invalid value raises :class:`~llmd_supervisor.errors.SpecError` naming the field
(dotted path), the value and the fix; unknown keys are errors too. Values that end up in
the batch script (paths, names, Slurm settings, container image) must match conservative
patterns, so a spec cannot inject shell even before the renderer quotes them. Commands
and environment values never pass through a shell: they travel as JSON to the node agent,
which execs argv lists; they only have to be free of control characters.

Layout (see ``deploy/llm-d/demo.toml``)::

    [run]        name (what `list` calls the run), log_dir, sigterm_grace_s, marker_grace_s,
                 coordinator_silence_s
    [topology]   prefill_nodes, decode_nodes, prefill_workers, decode_workers, gpus_per_node,
                 nominal_gpus_per_node
    [model]      path, served_name
    [container]  kind = none|docker|pyxis, image, squash_file, mounts, python,
                 extra_args (allow-listed docker/pyxis options), user (docker UID[:GID])
    [engine]     port, port_stride, health_path, health_timeout_s,
                 prefill_command, decode_command
    [benchmark]  command, input_len, output_len, concurrencies, prompts_multiplier,
                 request_rate, point_timeout_s, result_format = vllm|inferencex
    [benchmark.validity]  min_completed_fraction, min_output_tokens, max_failed
                 (see :mod:`llmd_supervisor.core.spec.bench`)
    [slurm]      partition, account, time_limit, extra_args, requeue
    [retry]      infrastructure, exclude_nodes, backoff_s, hold_timeout_s (see
                 :mod:`llmd_supervisor.core.run.retry_policy`)
    [env.common] [env.prefill] [env.decode] [env.bench]   NAME = "value"
    [recipe]     hw, framework, precision, model_prefix, spec_decoding, per-role tp, pp,
                 ep, dp_attention, ... (published names only; see
                 :mod:`llmd_supervisor.core.spec.recipe_table`)
    [standins]   enabled: the batch script carries the stand-ins (tests and the dev
                 cluster only; see :mod:`llmd_supervisor.core.spec.standins`)
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from llmd_supervisor.core.events.routing import parse_named
from llmd_supervisor.core.results.evidence import Validity
from llmd_supervisor.core.run.retry_policy import RETRY_KEYS, RetryPolicy, parse_retry
from llmd_supervisor.core.spec.bench import BENCHMARK_KEYS, Benchmark, parse_benchmark
from llmd_supervisor.core.spec.container import (
    IMAGE_RE,
    Container,
    ContainerKind,
    mount_source_error,
    overlapping,
    parse_container,
)
from llmd_supervisor.core.spec.fields import (
    CONTROL_RE,
    PATH_RE,
    PLACEHOLDER_RE,
    check_keys,
    command_field,
    int_field,
    list_field,
    num_field,
    path_field,
    pattern_field,
    shown,
)
from llmd_supervisor.core.spec.recipe_table import RECIPE_KEYS, Recipe, parse_recipe
from llmd_supervisor.core.spec.services import (
    SERVICE_PLACEHOLDERS,
    HealthScope,
    Router,
    Sidecar,
    health_scope,
    parse_router,
    parse_sidecar,
)
from llmd_supervisor.core.spec.slurm_table import (
    ALLOWED_SBATCH_OPTIONS,
    EXTRA_ARG_RE,
    MAX_EXTRA_ARGS,
    RESERVED_SBATCH_OPTIONS,
    TIME_RE,
    extra_arg,
    time_limit_seconds,
)
from llmd_supervisor.core.spec.standins import STANDINS_KEYS, check_standins, parse_standins
from llmd_supervisor.core.spec.toml_read import decode_toml
from llmd_supervisor.errors import SpecError
from llmd_supervisor.node import common as shared

__all__ = [
    "ALLOWED_SBATCH_OPTIONS",
    "BENCH_PLACEHOLDERS",
    "CONTROL_RE",
    "ENGINE_PLACEHOLDERS",
    "ENV_NAME_RE",
    "EXTRA_ARG_RE",
    "HEALTH_PATH_RE",
    "IMAGE_RE",
    "JOB_NAME_RE",
    "MAX_GRACE_S",
    "MAX_NODES",
    "NAME_RE",
    "PATH_RE",
    "PLACEHOLDER_RE",
    "RESERVED_SBATCH_OPTIONS",
    "SERVED_NAME_RE",
    "SPEC_FIELDS",
    "TIME_RE",
    "Benchmark",
    "Container",
    "ContainerKind",
    "Engine",
    "Env",
    "Model",
    "RunSpec",
    "Slurm",
    "Topology",
    "Validity",
    "check_daemon_dirs",
    "load_spec",
    "parse_spec",
    "time_limit_seconds",
]

# --- patterns ---------------------------------------------------------------------------

NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
JOB_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SERVED_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,199}")
ENV_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
HEALTH_PATH_RE: Final = re.compile(r"/[A-Za-z0-9._/-]{0,200}")
ENGINE_PLACEHOLDERS: Final = frozenset(
    {
        "rank",
        "role",
        "host",
        "port",
        "group",
        "group_rank",
        "group_size",
        "leader_host",
        "leader_port",
        "host_ip",  # this node's IPv4 (the default route's source, else its name resolved)
        "iface",  # the interface holding it (NCCL/GLOO_SOCKET_IFNAME)
        "leader_ip",  # the group leader's IPv4
        "gpus_per_node",
        "model_path",
        "served_name",
        "log_dir",
        "job_dir",
        "node_dir",
        "job_id",
    }
)
BENCH_PLACEHOLDERS: Final = ENGINE_PLACEHOLDERS | {
    "concurrency",
    "num_prompts",
    "input_len",
    "output_len",
    "request_rate",
    "prefill_urls",
    "decode_urls",
    "result_file",
}

# A router's or sidecar's command: the engine's placeholders and the topology's ports.
SERVICE_COMMAND_PLACEHOLDERS: Final = ENGINE_PLACEHOLDERS | SERVICE_PLACEHOLDERS - {"router_url"}

MAX_GRACE_S: Final = 3600
MAX_NODES: Final = 1024


# --- the spec -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    prefill_nodes: int
    decode_nodes: int
    prefill_workers: int = 1
    decode_workers: int = 1
    gpus_per_node: int = 0
    # GPUs each node counts for in per-GPU numbers when it requests none from Slurm (the
    # dev cluster's stand-ins; gpus_per_node wins when set); never rendered into the batch
    # script, so a spec derived from the demo may still set gpus_per_node.
    nominal_gpus_per_node: int = 0

    @property
    def nodes(self) -> int:
        return self.prefill_nodes + self.decode_nodes

    @property
    def counted_gpus_per_node(self) -> int:
        """The GPUs per node that per-GPU numbers divide by (0: unknown)."""
        return self.gpus_per_node or self.nominal_gpus_per_node

    @property
    def coordinator_rank(self) -> int:
        return self.prefill_nodes


@dataclass(frozen=True)
class Model:
    path: str
    served_name: str


@dataclass(frozen=True)
class Engine:
    prefill_command: tuple[str, ...]
    decode_command: tuple[str, ...]
    port: int = 8000
    port_stride: int = 0
    health_path: str = "/health"
    health_timeout_s: float = 600.0
    # Which nodes of a role answer health checks: "all", group "leaders" (followers run
    # --headless, with no HTTP API) or "none".
    prefill_health: HealthScope = "all"
    decode_health: HealthScope = "all"


@dataclass(frozen=True)
class Slurm:
    time_limit: str
    partition: str | None = None
    account: str | None = None
    extra_args: tuple[str, ...] = ()
    requeue: bool = False

    @property
    def time_limit_s(self) -> int:
        return time_limit_seconds(self.time_limit)


@dataclass(frozen=True)
class Env:
    common: Mapping[str, str] = field(default_factory=dict)
    prefill: Mapping[str, str] = field(default_factory=dict)
    decode: Mapping[str, str] = field(default_factory=dict)
    bench: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSpec:
    log_dir: str
    topology: Topology
    model: Model
    container: Container
    engine: Engine
    benchmark: Benchmark
    slurm: Slurm
    env: Env
    router: Router | None = None  # processes on the coordinator (Envoy + EPP)
    sidecar: Sidecar | None = None  # the P/D sidecar on decode nodes
    sigterm_grace_s: int = 30
    marker_grace_s: float = shared.MARKER_GRACE_S
    coordinator_silence_s: float = shared.COORDINATOR_SILENCE_S
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    recipe: Recipe = field(default_factory=Recipe)
    standins: bool = False  # the batch script carries the stand-ins (tests, dev cluster)
    name: str = ""  # [run] name: what `list` and `status` call the run ("" when unnamed)
    # [notify] destinations: names of the daemon's configured event destinations (never a
    # URL); checked against the daemon config at submit (`core.events.routing.check_named`).
    notify: tuple[str, ...] = ()


# --- loading ------------------------------------------------------------------------------

_TABLES: Final = {
    "run": ("name", "log_dir", "sigterm_grace_s", "marker_grace_s", "coordinator_silence_s"),
    "topology": (
        "prefill_nodes",
        "decode_nodes",
        "prefill_workers",
        "decode_workers",
        "gpus_per_node",
        "nominal_gpus_per_node",
    ),
    "model": ("path", "served_name"),
    "container": ("kind", "image", "squash_file", "mounts", "python", "extra_args", "user"),
    "engine": (
        "prefill_command",
        "decode_command",
        "port",
        "port_stride",
        "health_path",
        "health_timeout_s",
        "prefill_health",
        "decode_health",
    ),
    "benchmark": BENCHMARK_KEYS,
    "retry": RETRY_KEYS,
    "router": ("port", "process"),
    "sidecar": ("command", "port", "health_path", "startup_timeout_s", "on"),
    "slurm": ("partition", "account", "time_limit", "extra_args", "requeue"),
    "env": ("common", "prefill", "decode", "bench"),
    "recipe": RECIPE_KEYS,
    "standins": STANDINS_KEYS,
    "notify": ("destinations",),
}
# The tables of a run spec and each one's keys (campaign matrix keys are `<table>.<key>`).
SPEC_FIELDS: Final = _TABLES
_REQUIRED_TABLES: Final = ("run", "topology", "model", "engine", "benchmark", "slurm")


def load_spec(text: str) -> RunSpec:
    """Parse and validate a run spec from TOML text."""
    return parse_spec(decode_toml(text))


def parse_spec(data: Mapping[str, object]) -> RunSpec:
    """Validate an already-decoded spec mapping (the shape ``tomllib`` returns)."""
    check_keys("", data, tuple(_TABLES))
    for name in _REQUIRED_TABLES:
        if name not in data:
            raise SpecError(name, None, f"the [{name}] table is required")
    t = {name: _table(data, name) for name in _TABLES}

    run = t["run"]
    topo = _parse_topology(t["topology"])
    grace = int_field(run, "run.sigterm_grace_s", default=30, lo=1, hi=MAX_GRACE_S)
    slurm = _parse_slurm(t["slurm"])
    if grace >= slurm.time_limit_s:
        raise SpecError(
            "run.sigterm_grace_s",
            grace,
            f"must be shorter than slurm.time_limit ({slurm.time_limit} = "
            f"{slurm.time_limit_s} s) so the TERM can arrive before the limit",
        )
    log_dir = path_field(run, "run.log_dir", required=True) or ""
    run_name = pattern_field(
        run,
        "run.name",
        NAME_RE,
        'use 1 to 64 letters, digits and . _ -, first a letter or digit, e.g. name = "dsr1-2p1d"',
    )
    model = _parse_model(t["model"])
    router = parse_router(t["router"], SERVICE_COMMAND_PLACEHOLDERS)
    container = parse_container(t["container"])
    if container.kind is not ContainerKind.NONE:  # both are mounted into the container too
        for fld, path in (("run.log_dir", log_dir), ("model.path", model.path)):
            why = mount_source_error(path)
            if why is not None:
                raise SpecError(fld, path, f"it is mounted into the container, and {why}")
    spec = RunSpec(
        log_dir=log_dir,
        topology=topo,
        model=model,
        container=container,
        engine=_parse_engine(t["engine"]),
        benchmark=parse_benchmark(
            t["benchmark"], BENCH_PLACEHOLDERS | ({"router_url"} if router else set())
        ),
        slurm=slurm,
        env=_parse_env(t["env"]),
        router=router,
        sidecar=parse_sidecar(t["sidecar"], SERVICE_COMMAND_PLACEHOLDERS),
        sigterm_grace_s=grace,
        marker_grace_s=num_field(
            run, "run.marker_grace_s", default=shared.MARKER_GRACE_S, lo=0.0, hi=3600.0
        ),
        coordinator_silence_s=num_field(
            run,
            "run.coordinator_silence_s",
            default=shared.COORDINATOR_SILENCE_S,
            lo=1.0,
            hi=86400.0,
        ),
        retry=parse_retry(t["retry"]),
        recipe=parse_recipe(t["recipe"]),
        standins=parse_standins(t["standins"]),
        name=run_name or "",
        notify=parse_named(t["notify"].get("destinations", [])),
    )
    check_standins(spec.standins, _commands(spec), _env_tables(spec.env))
    return spec


def _commands(spec: RunSpec) -> list[tuple[str, tuple[str, ...]]]:
    """Every command of `spec` with its field name."""
    cmds = [
        ("engine.prefill_command", spec.engine.prefill_command),
        ("engine.decode_command", spec.engine.decode_command),
        ("benchmark.command", spec.benchmark.command),
    ]
    if spec.router is not None:
        cmds += [
            (f"router.process[{i}].command", p.command) for i, p in enumerate(spec.router.processes)
        ]
    if spec.sidecar is not None:
        cmds.append(("sidecar.command", spec.sidecar.service.command))
    return cmds


def _env_tables(env: Env) -> list[tuple[str, Mapping[str, str]]]:
    return [
        ("common", env.common),
        ("prefill", env.prefill),
        ("decode", env.decode),
        ("bench", env.bench),
    ]


def _parse_topology(t: Mapping[str, object]) -> Topology:
    p = int_field(t, "topology.prefill_nodes", lo=1, hi=MAX_NODES)
    d = int_field(t, "topology.decode_nodes", lo=1, hi=MAX_NODES)
    pw = int_field(t, "topology.prefill_workers", default=1, lo=1, hi=MAX_NODES)
    dw = int_field(t, "topology.decode_workers", default=1, lo=1, hi=MAX_NODES)
    if p % pw:
        raise SpecError(
            "topology.prefill_workers",
            pw,
            f"prefill_nodes ({p}) must be divisible by it; use a divisor of {p}",
        )
    if d % dw:
        raise SpecError(
            "topology.decode_workers",
            dw,
            f"decode_nodes ({d}) must be divisible by it; use a divisor of {d}",
        )
    gpus = int_field(t, "topology.gpus_per_node", default=0, lo=0, hi=64)
    nominal = int_field(t, "topology.nominal_gpus_per_node", default=0, lo=0, hi=64)
    return Topology(p, d, pw, dw, gpus, nominal)


def _parse_model(t: Mapping[str, object]) -> Model:
    return Model(
        path=path_field(t, "model.path", required=True) or "",
        served_name=pattern_field(
            t,
            "model.served_name",
            SERVED_NAME_RE,
            "use letters, digits and . _ / : - (e.g. 'meta-llama/Llama-3.1-8B')",
            required=True,
        )
        or "",
    )


def _parse_engine(t: Mapping[str, object]) -> Engine:
    return Engine(
        prefill_command=command_field(t, "engine.prefill_command", ENGINE_PLACEHOLDERS),
        decode_command=command_field(t, "engine.decode_command", ENGINE_PLACEHOLDERS),
        port=int_field(t, "engine.port", default=8000, lo=1024, hi=65535),
        port_stride=int_field(t, "engine.port_stride", default=0, lo=0, hi=1000),
        health_path=pattern_field(
            t, "engine.health_path", HEALTH_PATH_RE, "use a URL path like '/health'"
        )
        or "/health",
        health_timeout_s=num_field(t, "engine.health_timeout_s", default=600.0, lo=1.0, hi=86400.0),
        prefill_health=health_scope(t, "engine.prefill_health"),
        decode_health=health_scope(t, "engine.decode_health"),
    )


def _parse_slurm(t: Mapping[str, object]) -> Slurm:
    time_limit = pattern_field(
        t,
        "slurm.time_limit",
        TIME_RE,
        "use a Slurm time like '30', '01:30:00' or '1-00:00:00'",
        required=True,
    )
    assert time_limit is not None
    if time_limit_seconds(time_limit) < 60:
        raise SpecError("slurm.time_limit", time_limit, "Slurm's minimum is 1 minute")
    hint = "use letters, digits and . _ - (at most 64 characters)"
    args = list_field(t, "slurm.extra_args")
    if len(args) > MAX_EXTRA_ARGS:
        raise SpecError(
            "slurm.extra_args", f"{len(args)} entries", f"give at most {MAX_EXTRA_ARGS}"
        )
    extra = [extra_arg(f"slurm.extra_args[{i}]", arg) for i, arg in enumerate(args)]
    requeue = t.get("requeue", False)
    if not isinstance(requeue, bool):
        raise SpecError("slurm.requeue", requeue, "use true or false (default false)")
    return Slurm(
        time_limit=time_limit,
        partition=pattern_field(t, "slurm.partition", NAME_RE, hint),
        account=pattern_field(t, "slurm.account", NAME_RE, hint),
        extra_args=tuple(extra),
        requeue=requeue,
    )


def _parse_env(t: Mapping[str, object]) -> Env:
    roles: dict[str, dict[str, str]] = {}
    for role in _TABLES["env"]:
        table = t.get(role, {})
        if not isinstance(table, Mapping):
            raise SpecError(f"env.{role}", table, f'use a table [env.{role}] of NAME = "value"')
        out: dict[str, str] = {}
        for name, value in table.items():
            fld = f"env.{role}.{name}"
            if not ENV_NAME_RE.fullmatch(name):
                raise SpecError(
                    fld, name, "variable names are letters, digits and _, not first a digit"
                )
            if name.startswith(("SLURM_", "LLMD_RANK", "LLMD_ROLE", "LLMD_JOB_")):
                raise SpecError(fld, name, "SLURM_* and LLMD_RANK/ROLE/JOB_* are set by the agent")
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise SpecError(fld, value, "use a string (or number) value")
            text = str(value)
            if CONTROL_RE.search(text):
                raise SpecError(fld, shown(text), "remove control characters (newlines, tabs, NUL)")
            out[name] = text
        roles[role] = out
    return Env(**roles)


def _table(data: Mapping[str, object], name: str) -> Mapping[str, object]:
    value = data.get(name, {})
    if not isinstance(value, Mapping):
        raise SpecError(name, value, f"[{name}] must be a table")
    check_keys(name, value, _TABLES[name])
    return value


def check_daemon_dirs(spec: RunSpec, dirs: Sequence[str]) -> None:
    """Refuse a spec that would reach into one of the daemon's own directories.

    `dirs` are the daemon's state, archive and socket directories (absolute). The log
    directory may not be one of them or lie inside one; a container mount source (the
    spec's, and the log and model directories the renderer mounts) may not overlap one
    either way (mounting ``/var`` would expose ``/var/lib/llmd-supervisor``).
    """
    daemon = [posixpath.normpath(d) for d in dirs]
    for d in daemon:
        if spec.log_dir == d or spec.log_dir.startswith(d.rstrip("/") + "/"):
            raise SpecError(
                "run.log_dir",
                spec.log_dir,
                f"it lies inside the supervisor's directory {d}; use a directory of your own",
            )
    if spec.container.kind is ContainerKind.NONE:
        return
    sources = [("run.log_dir", spec.log_dir), ("model.path", spec.model.path)]
    sources += [(f"container.mounts[{i}]", m) for i, m in enumerate(spec.container.mounts)]
    for fld, value in sources:
        hit = overlapping(value.split(":")[0], daemon)
        if hit is not None:
            raise SpecError(
                fld,
                value,
                f"it is mounted into the container and overlaps the supervisor's directory {hit}"
                "; mount a directory that neither holds nor lies inside it",
            )
