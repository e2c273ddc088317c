"""The llm-d run spec: TOML in, validated frozen dataclasses out (pure, no I/O).

Every invalid value raises :class:`~llmd_supervisor.errors.SpecError` naming the field
(dotted path), the value and the fix; unknown keys are errors too. Values that end up in
the batch script (paths, names, Slurm settings, container image) must match conservative
patterns, so a spec cannot inject shell even before the renderer quotes them. Commands
and environment values never pass through a shell: they travel as JSON to the node agent,
which execs argv lists; they only have to be free of control characters.

Layout (see ``deploy/llm-d/demo.toml``)::

    [run]        log_dir, sigterm_grace_s, marker_grace_s, coordinator_silence_s
    [topology]   prefill_nodes, decode_nodes, prefill_workers, decode_workers, gpus_per_node
    [model]      path, served_name
    [container]  kind = none|docker|pyxis, image, squash_file, mounts, python
    [engine]     port, port_stride, health_path, health_timeout_s,
                 prefill_command, decode_command
    [benchmark]  command, input_len, output_len, concurrencies, prompts_multiplier,
                 request_rate, point_timeout_s
    [slurm]      partition, account, time_limit, extra_args, requeue
    [env.common] [env.prefill] [env.decode] [env.bench]   NAME = "value"
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from llmd_supervisor.errors import SpecError

# --- patterns ---------------------------------------------------------------------------

# Absolute path, no spaces, quotes, `$`, `%` (sbatch filename patterns) or other metachars.
PATH_RE: Final = re.compile(r"/(?:[A-Za-z0-9._+-]+/?)*")
NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
JOB_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SERVED_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,199}")
IMAGE_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,255}")
PYTHON_RE: Final = re.compile(r"[A-Za-z0-9._/+-]{1,200}")
ENV_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
HEALTH_PATH_RE: Final = re.compile(r"/[A-Za-z0-9._/-]{0,200}")
# Slurm --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
TIME_RE: Final = re.compile(r"(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)")
EXTRA_ARG_RE: Final = re.compile(r"--([a-z][a-z0-9-]*)(?:=([A-Za-z0-9._:,/@+=-]*))?")
PLACEHOLDER_RE: Final = re.compile(r"\{\{|\}\}|\{([a-z_]+)\}|[{}]")
CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f]")

# Options the renderer owns; an extra arg may not set them, nor be a prefix of one
# (Slurm accepts unambiguous abbreviations of long options).
RESERVED_SBATCH_OPTIONS: Final = frozenset(
    {
        "job-name",
        "nodes",
        "ntasks",
        "ntasks-per-node",
        "output",
        "error",
        "signal",
        "requeue",
        "no-requeue",
        "time",
        "partition",
        "account",
        "gpus-per-node",
        "array",
        "wrap",
        "export",
        "chdir",
        "input",
        "open-mode",
        "parsable",
        "wait",
    }
)

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

MAX_GRACE_S: Final = 3600
MAX_NODES: Final = 1024


class ContainerKind(StrEnum):
    """How the node agent and engines are started on each node."""

    NONE = "none"  # bare processes with the node's python3 (dev cluster)
    DOCKER = "docker"  # `docker run --network=host` per task
    PYXIS = "pyxis"  # srun --container-image=<squash file> (enroot/pyxis)


# --- the spec -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    prefill_nodes: int
    decode_nodes: int
    prefill_workers: int = 1
    decode_workers: int = 1
    gpus_per_node: int = 0

    @property
    def nodes(self) -> int:
        return self.prefill_nodes + self.decode_nodes

    @property
    def coordinator_rank(self) -> int:
        return self.prefill_nodes


@dataclass(frozen=True)
class Model:
    path: str
    served_name: str


@dataclass(frozen=True)
class Container:
    kind: ContainerKind = ContainerKind.NONE
    image: str | None = None
    squash_file: str | None = None
    mounts: tuple[str, ...] = ()
    python: str = "python3"


@dataclass(frozen=True)
class Engine:
    prefill_command: tuple[str, ...]
    decode_command: tuple[str, ...]
    port: int = 8000
    port_stride: int = 0
    health_path: str = "/health"
    health_timeout_s: float = 600.0


@dataclass(frozen=True)
class Benchmark:
    command: tuple[str, ...]
    concurrencies: tuple[int, ...]
    input_len: int = 1024
    output_len: int = 256
    prompts_multiplier: int = 10
    request_rate: float = math.inf
    point_timeout_s: float = 3600.0


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
    sigterm_grace_s: int = 30
    marker_grace_s: float = 10.0
    coordinator_silence_s: float = 60.0


# --- loading ------------------------------------------------------------------------------

_TABLES: Final = {
    "run": ("log_dir", "sigterm_grace_s", "marker_grace_s", "coordinator_silence_s"),
    "topology": (
        "prefill_nodes",
        "decode_nodes",
        "prefill_workers",
        "decode_workers",
        "gpus_per_node",
    ),
    "model": ("path", "served_name"),
    "container": ("kind", "image", "squash_file", "mounts", "python"),
    "engine": (
        "prefill_command",
        "decode_command",
        "port",
        "port_stride",
        "health_path",
        "health_timeout_s",
    ),
    "benchmark": (
        "command",
        "concurrencies",
        "input_len",
        "output_len",
        "prompts_multiplier",
        "request_rate",
        "point_timeout_s",
    ),
    "slurm": ("partition", "account", "time_limit", "extra_args", "requeue"),
    "env": ("common", "prefill", "decode", "bench"),
}
_REQUIRED_TABLES: Final = ("run", "topology", "model", "engine", "benchmark", "slurm")


def load_spec(text: str) -> RunSpec:
    """Parse and validate a run spec from TOML text."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError("<toml>", text[:80], f"the file is not valid TOML ({exc})") from exc
    return parse_spec(data)


def parse_spec(data: Mapping[str, object]) -> RunSpec:
    """Validate an already-decoded spec mapping (the shape ``tomllib`` returns)."""
    _check_keys("", data, tuple(_TABLES))
    for name in _REQUIRED_TABLES:
        if name not in data:
            raise SpecError(name, None, f"the [{name}] table is required")
    t = {name: _table(data, name) for name in _TABLES}

    run = t["run"]
    topo = _parse_topology(t["topology"])
    grace = _int(run, "run.sigterm_grace_s", default=30, lo=1, hi=MAX_GRACE_S)
    slurm = _parse_slurm(t["slurm"])
    if grace >= slurm.time_limit_s:
        raise SpecError(
            "run.sigterm_grace_s",
            grace,
            f"must be shorter than slurm.time_limit ({slurm.time_limit} = "
            f"{slurm.time_limit_s} s) so the TERM can arrive before the limit",
        )
    return RunSpec(
        log_dir=_path(run, "run.log_dir", required=True) or "",
        topology=topo,
        model=_parse_model(t["model"]),
        container=_parse_container(t["container"]),
        engine=_parse_engine(t["engine"]),
        benchmark=_parse_benchmark(t["benchmark"]),
        slurm=slurm,
        env=_parse_env(t["env"]),
        sigterm_grace_s=grace,
        marker_grace_s=_num(run, "run.marker_grace_s", default=10.0, lo=0.0, hi=3600.0),
        coordinator_silence_s=_num(
            run, "run.coordinator_silence_s", default=60.0, lo=1.0, hi=86400.0
        ),
    )


def _parse_topology(t: Mapping[str, object]) -> Topology:
    p = _int(t, "topology.prefill_nodes", lo=1, hi=MAX_NODES)
    d = _int(t, "topology.decode_nodes", lo=1, hi=MAX_NODES)
    pw = _int(t, "topology.prefill_workers", default=1, lo=1, hi=MAX_NODES)
    dw = _int(t, "topology.decode_workers", default=1, lo=1, hi=MAX_NODES)
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
    gpus = _int(t, "topology.gpus_per_node", default=0, lo=0, hi=64)
    return Topology(p, d, pw, dw, gpus)


def _parse_model(t: Mapping[str, object]) -> Model:
    return Model(
        path=_path(t, "model.path", required=True) or "",
        served_name=_pattern(
            t,
            "model.served_name",
            SERVED_NAME_RE,
            "use letters, digits and . _ / : - (e.g. 'meta-llama/Llama-3.1-8B')",
            required=True,
        )
        or "",
    )


def _parse_container(t: Mapping[str, object]) -> Container:
    raw_kind = t.get("kind", "none")
    try:
        kind = ContainerKind(raw_kind if isinstance(raw_kind, str) else "")
    except ValueError:
        raise SpecError(
            "container.kind", raw_kind, "use one of 'none', 'docker', 'pyxis'"
        ) from None
    image = _pattern(
        t, "container.image", IMAGE_RE, "use a registry reference like 'vllm/vllm-openai:v0.9'"
    )
    squash = _path(t, "container.squash_file")
    mounts = tuple(
        _mount(f"container.mounts[{i}]", m) for i, m in enumerate(_list(t, "container.mounts"))
    )
    python = _pattern(
        t, "container.python", PYTHON_RE, "name an interpreter like 'python3' or '/usr/bin/python3'"
    )
    if kind is ContainerKind.DOCKER and image is None:
        raise SpecError("container.image", None, "container.kind 'docker' needs an image")
    if kind is ContainerKind.PYXIS and squash is None:
        raise SpecError(
            "container.squash_file", None, "container.kind 'pyxis' needs a squash file path"
        )
    if kind is ContainerKind.NONE and (image or squash or mounts):
        raise SpecError(
            "container.kind",
            "none",
            "image/squash_file/mounts only apply to 'docker' or 'pyxis'; remove them or set kind",
        )
    if kind is ContainerKind.DOCKER and squash is not None:
        raise SpecError("container.squash_file", squash, "only 'pyxis' uses a squash file")
    if kind is ContainerKind.PYXIS and image is not None:
        raise SpecError(
            "container.image", image, "'pyxis' runs container.squash_file; remove image"
        )
    return Container(kind, image, squash, mounts, python or "python3")


def _mount(fld: str, value: object) -> str:
    if not isinstance(value, str):
        raise SpecError(fld, value, "a mount is a string 'SRC:DST' or 'SRC:DST:ro'")
    parts = value.split(":")
    ok = len(parts) in (2, 3) and all(PATH_RE.fullmatch(p) for p in parts[:2])
    if not ok or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise SpecError(fld, value, "use 'SRC:DST' or 'SRC:DST:ro' with absolute, plain paths")
    return value


def _parse_engine(t: Mapping[str, object]) -> Engine:
    return Engine(
        prefill_command=_command(t, "engine.prefill_command", ENGINE_PLACEHOLDERS),
        decode_command=_command(t, "engine.decode_command", ENGINE_PLACEHOLDERS),
        port=_int(t, "engine.port", default=8000, lo=1024, hi=65535),
        port_stride=_int(t, "engine.port_stride", default=0, lo=0, hi=1000),
        health_path=_pattern(
            t, "engine.health_path", HEALTH_PATH_RE, "use a URL path like '/health'"
        )
        or "/health",
        health_timeout_s=_num(t, "engine.health_timeout_s", default=600.0, lo=1.0, hi=86400.0),
    )


def _parse_benchmark(t: Mapping[str, object]) -> Benchmark:
    raw = _list(t, "benchmark.concurrencies", required=True)
    if not raw:
        raise SpecError("benchmark.concurrencies", raw, "list at least one concurrency")
    concs: list[int] = []
    for i, c in enumerate(raw):
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 100000:
            raise SpecError(
                f"benchmark.concurrencies[{i}]", c, "each concurrency is an integer 1..100000"
            )
        concs.append(c)
    if len(set(concs)) != len(concs):
        raise SpecError("benchmark.concurrencies", raw, "remove the duplicate concurrencies")
    rate_raw = t.get("request_rate", "inf")
    if rate_raw == "inf":
        rate = math.inf
    elif isinstance(rate_raw, int | float) and not isinstance(rate_raw, bool) and rate_raw > 0:
        rate = float(rate_raw)
        if not math.isfinite(rate):
            rate = math.inf
    else:
        raise SpecError(
            "benchmark.request_rate", rate_raw, "use a positive number of requests/s or 'inf'"
        )
    return Benchmark(
        command=_command(t, "benchmark.command", BENCH_PLACEHOLDERS),
        concurrencies=tuple(concs),
        input_len=_int(t, "benchmark.input_len", default=1024, lo=1, hi=10_000_000),
        output_len=_int(t, "benchmark.output_len", default=256, lo=1, hi=10_000_000),
        prompts_multiplier=_int(t, "benchmark.prompts_multiplier", default=10, lo=1, hi=100000),
        request_rate=rate,
        point_timeout_s=_num(t, "benchmark.point_timeout_s", default=3600.0, lo=1.0, hi=604800.0),
    )


def _parse_slurm(t: Mapping[str, object]) -> Slurm:
    time_limit = _pattern(
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
    extra: list[str] = []
    for i, arg in enumerate(_list(t, "slurm.extra_args")):
        extra.append(_extra_arg(f"slurm.extra_args[{i}]", arg))
    requeue = t.get("requeue", False)
    if not isinstance(requeue, bool):
        raise SpecError("slurm.requeue", requeue, "use true or false (default false)")
    return Slurm(
        time_limit=time_limit,
        partition=_pattern(t, "slurm.partition", NAME_RE, hint),
        account=_pattern(t, "slurm.account", NAME_RE, hint),
        extra_args=tuple(extra),
        requeue=requeue,
    )


def _extra_arg(fld: str, arg: object) -> str:
    if not isinstance(arg, str):
        raise SpecError(fld, arg, "each extra sbatch arg is a string like '--exclusive'")
    m = EXTRA_ARG_RE.fullmatch(arg)
    if m is None:
        raise SpecError(
            fld,
            arg,
            "write it as '--option' or '--option=value'"
            " (value: letters, digits and . _ : , / @ + = -)",
        )
    name = m.group(1)
    clash = sorted(o for o in RESERVED_SBATCH_OPTIONS if o.startswith(name))
    if clash:
        raise SpecError(
            fld,
            arg,
            f"--{clash[0]} is set by the supervisor from the spec and cannot be overridden"
            " (use the matching spec field instead)",
        )
    return arg


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
                raise SpecError(fld, text, "remove control characters (newlines, tabs, NUL)")
            out[name] = text
        roles[role] = out
    return Env(**roles)


# --- field helpers --------------------------------------------------------------------------


def _check_keys(prefix: str, table: Mapping[str, object], allowed: Sequence[str]) -> None:
    for key in table:
        if key not in allowed:
            where = f"{prefix}.{key}" if prefix else key
            scope = f"in [{prefix}]" if prefix else "at the top level"
            raise SpecError(
                where, table[key], f"unknown key; allowed {scope}: {', '.join(allowed)}"
            )


def _table(data: Mapping[str, object], name: str) -> Mapping[str, object]:
    value = data.get(name, {})
    if not isinstance(value, Mapping):
        raise SpecError(name, value, f"[{name}] must be a table")
    _check_keys(name, value, _TABLES[name])
    return value


def _present(t: Mapping[str, object], fld: str, required: bool) -> object | None:
    key = fld.rsplit(".", 1)[1]
    value = t.get(key)
    if value is None and required:
        raise SpecError(fld, None, "this field is required")
    return value


def _int(t: Mapping[str, object], fld: str, *, default: int | None = None, lo: int, hi: int) -> int:
    value = _present(t, fld, default is None)
    if value is None:
        assert default is not None
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpecError(fld, value, f"use an integer from {lo} to {hi}")
    return value


def _num(t: Mapping[str, object], fld: str, *, default: float, lo: float, hi: float) -> float:
    value = _present(t, fld, False)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not lo <= value <= hi
    ):
        raise SpecError(fld, value, f"use a number of seconds from {lo:g} to {hi:g}")
    return float(value)


def _pattern(
    t: Mapping[str, object],
    fld: str,
    pattern: re.Pattern[str],
    hint: str,
    *,
    required: bool = False,
) -> str | None:
    value = _present(t, fld, required)
    if value is None:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise SpecError(fld, value, hint)
    return value


def _path(t: Mapping[str, object], fld: str, *, required: bool = False) -> str | None:
    value = _pattern(
        t,
        fld,
        PATH_RE,
        "use an absolute path of letters, digits and . _ + - / (no spaces, quotes, $ or %)",
        required=required,
    )
    if value is not None and value != "/":
        value = value.rstrip("/")
    return value


def _list(t: Mapping[str, object], fld: str, *, required: bool = False) -> list[object]:
    value = _present(t, fld, required)
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(fld, value, 'use a list, e.g. ["a", "b"]')
    return value


def _command(t: Mapping[str, object], fld: str, placeholders: frozenset[str]) -> tuple[str, ...]:
    items = _list(t, fld, required=True)
    if not items:
        raise SpecError(fld, items, "give the command as a non-empty argv list")
    argv: list[str] = []
    for i, item in enumerate(items):
        where = f"{fld}[{i}]"
        if not isinstance(item, str) or not item:
            raise SpecError(where, item, "each argv element is a non-empty string")
        if CONTROL_RE.search(item):
            raise SpecError(where, item, "remove control characters (newlines, tabs, NUL)")
        for m in PLACEHOLDER_RE.finditer(item):
            tok = m.group(0)
            if tok in ("{{", "}}"):
                continue
            name = m.group(1)
            if name is None:
                raise SpecError(where, item, "write literal braces as '{{' and '}}'")
            if name not in placeholders:
                raise SpecError(
                    where,
                    item,
                    f"unknown placeholder {{{name}}}; known: {', '.join(sorted(placeholders))}",
                )
        argv.append(item)
    return tuple(argv)


def time_limit_seconds(value: str) -> int:
    """Seconds in a Slurm ``--time`` value (``M``, ``M:S``, ``H:M:S``, ``D-H[:M[:S]]``)."""
    m = TIME_RE.fullmatch(value)
    if m is None:
        raise SpecError("slurm.time_limit", value, "use a Slurm time like '01:30:00'")
    days, dh, dm, ds, a, b, c = m.groups()
    if days is not None:
        return ((int(days) * 24 + int(dh)) * 60 + int(dm or 0)) * 60 + int(ds or 0)
    if c is not None:  # H:M:S
        return (int(a) * 60 + int(b)) * 60 + int(c)
    if b is not None:  # M:S
        return int(a) * 60 + int(b)
    return int(a) * 60
