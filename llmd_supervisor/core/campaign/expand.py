"""A campaign file and its expansion into jobs (pure, no I/O; DESIGN.md §12).

A campaign is a matrix of benchmark runs over one base run spec (or over a batch
script's environment: ``script = "job.slurm"`` and a ``[launcher]`` table instead of
``base``, see `core.campaign.script`; exactly one of the two)::

    name = "demo-sweep"          # optional, [A-Za-z0-9._-]{1,64}; default: the file's stem
    base = "demo.toml"           # the base run spec, relative to this file
    cluster = "dev"              # optional
    [limits]                     # see core.campaign.admission.CampaignLimits
    max_jobs = 2                 # default 4 (1..1000)
    max_pending = 2              # default max_jobs
    max_nodes = 16               # default: no cap
    max_gpus = 128               # default: no cap (counted GPUs)
    canary_stop_fraction = 0.5   # default 0.5
    [matrix]                     # every combination of these (keys in file order)
    "topology.prefill_nodes" = [1, 2]
    "benchmark.isl_osl" = [[1024, 1024], [8192, 1024]]   # input_len and output_len
    "benchmark.concurrencies" = [[1, 4, 16, 64]]
    [[zip]]                      # keys that vary together: one more dimension
    "benchmark.prompts_multiplier" = [4, 8]
    "benchmark.point_timeout_s" = [60, 120]
    [[exclude]]                  # drop every combination matching all of these values
    "topology.prefill_nodes" = 2
    "benchmark.isl_osl" = [8192, 1024]
    [[include]]                  # one extra point: these values over the base spec
    "topology.prefill_nodes" = 3

A key is a dotted run spec path ``<table>.<key>`` (``SPEC_FIELDS``),
``env.<role>.<NAME>``, ``benchmark.validity.<key>``, or the alias ``benchmark.isl_osl``.
``run.log_dir`` is not a key: every run of a campaign writes under the base's log dir.

Expansion applies each combination's values to a copy of the decoded base spec and
validates it with ``parse_spec``. A **point** is (recipe id, concurrency); the recipe id
(:func:`recipe_id`) hashes what defines the configuration, not the concurrencies, names,
partition, account or time limit. Combinations with one recipe id are one **job**: it
runs the union of their concurrencies. A script campaign expands the same way
(`expand_script`), its points' keys and recipe ids being `core.campaign.script`'s. Every
error is a
:class:`~llmd_supervisor.errors.CampaignError` naming the field, the value and the fix.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from llmd_supervisor.core.campaign import script as script_campaign
from llmd_supervisor.core.campaign.admission import CampaignLimits, topology_key
from llmd_supervisor.core.campaign.script import Launcher, ScriptJob, ScriptPoint
from llmd_supervisor.core.events.routing import parse_named
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.core.spec.bench import VALIDITY_KEYS
from llmd_supervisor.core.spec.fields import CONTROL_RE, shown
from llmd_supervisor.core.spec.recipe import recipe_fingerprint
from llmd_supervisor.core.spec.runspec import MAX_NODES, SPEC_FIELDS, RunSpec, parse_spec
from llmd_supervisor.core.spec.toml_read import decode_toml
from llmd_supervisor.core.spec.toml_write import dump_toml
from llmd_supervisor.errors import CampaignError, ExpansionStopped, SpecError

__all__ = [
    "CAMPAIGN_KEYS",
    "ISL_OSL",
    "LIMIT_KEYS",
    "MAX_EXCLUDES",
    "RECIPE_ID_SCHEMA",
    "Axis",
    "CampaignFile",
    "CampaignJob",
    "CampaignLimits",
    "Duplicate",
    "Expansion",
    "PointLimit",
    "Variant",
    "combinations",
    "expand",
    "expand_script",
    "job_spec",
    "job_text",
    "parse_campaign",
    "recipe_id",
]

CAMPAIGN_KEYS: Final = (
    "name", "base", "script", "cluster", "limits", "launcher", "matrix", "zip", "exclude",
    "include", "notify",
)  # fmt: skip
LIMIT_KEYS: Final = ("max_jobs", "max_pending", "max_nodes", "max_gpus", "canary_stop_fraction")
ISL_OSL: Final = "benchmark.isl_osl"
RECIPE_ID_SCHEMA: Final = 1
CAMPAIGN_NAME_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_GPUS: Final = 1_000_000
MAX_POINTS: Final = 10_000
# Combinations looked at per allowed point (the rest must be excluded) before refusing.
MAX_COMBINATIONS_PER_POINT: Final = 100
# [[exclude]] tables: each is checked against every combination looked at.
MAX_EXCLUDES: Final = 100
# Combinations x [[exclude]] tables over two or more keys checked at most (~2 s of CPU).
MAX_EXCLUDE_CHECKS: Final = 10_000_000
# Combinations looked at between two questions whether the expansion should stop.
_STOP_EVERY: Final = 1024
_ENV_ROLES: Final = SPEC_FIELDS["env"]

Values = tuple[tuple[str, object], ...]
Check = Callable[[str, str, object], None]  # (field, key, value): CampaignError if bad
Stop = Callable[[], bool]  # true once an expansion should stop (its client went away)


@dataclass(frozen=True)
class _Keys:
    """How a campaign's matrix keys and their values are checked (run spec or script)."""

    key: Check  # the key (the value only shown)
    value: Check  # one value of the key


# --- the file -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Axis:
    """One dimension of the matrix: a ``[matrix]`` key (one key) or a ``[[zip]]`` (its
    keys, varying together). `rows[i]` holds the i-th value of each key, in key order."""

    keys: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]


@dataclass(frozen=True)
class CampaignFile:
    name: str
    # As written: relative to the campaign file (the caller resolves them). Exactly one of
    # `base` (a run spec) and `script` (a batch script, with its `launcher`) is set.
    base: str | None
    cluster: str | None
    limits: CampaignLimits
    axes: tuple[Axis, ...]  # [matrix] keys in file order, then each [[zip]]
    excludes: tuple[Values, ...]
    includes: tuple[Values, ...]
    script: str | None = None
    launcher: Launcher | None = None
    # [notify] destinations: the configured event destinations its campaign.* events may
    # go to (opt-in ones); its runs' events follow their own spec's [notify].
    notify: tuple[str, ...] = ()


def _valid_keys() -> str:
    """The matrix keys, compactly, for the error naming an unknown one."""
    tables = [
        f"{table}.{{{','.join(k for k in keys if (table, k) != ('run', 'log_dir'))}}}"
        for table, keys in SPEC_FIELDS.items()
        if table != "env"
    ]
    return (
        "; ".join(tables)
        + f"; env.{{{','.join(_ENV_ROLES)}}}.<NAME>"
        + f"; benchmark.validity.{{{','.join(VALIDITY_KEYS)}}}; {ISL_OSL}"
    )


def _check_key(fld: str, key: str, value: object) -> None:
    """`key` is a run spec path a campaign may set."""
    if key == "run.log_dir":
        raise CampaignError(
            fld,
            shown(value),
            "run.log_dir cannot vary: every run of a campaign writes under the base spec's"
            " log dir; set it in the base spec",
        )
    parts = key.split(".")
    ok = key == ISL_OSL
    if len(parts) == 2 and parts[0] != "env":
        ok = ok or parts[1] in SPEC_FIELDS.get(parts[0], ())
    elif len(parts) == 3:
        ok = (parts[0] == "env" and parts[1] in _ENV_ROLES and bool(parts[2])) or (
            parts[:2] == ["benchmark", "validity"] and parts[2] in VALIDITY_KEYS
        )
    if not ok:
        raise CampaignError(
            fld, key, f"not a run spec field a campaign can set; use one of: {_valid_keys()}"
        )


def _targets(key: str) -> tuple[str, ...]:
    """The spec paths `key` sets."""
    return ("benchmark.input_len", "benchmark.output_len") if key == ISL_OSL else (key,)


def _check_value(fld: str, key: str, value: object) -> None:
    """What can be checked of one value before a spec is built: the isl_osl pair."""
    if key != ISL_OSL:
        return
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    ):
        raise CampaignError(
            fld, shown(value), "give benchmark.isl_osl as [input_len, output_len], e.g. [1024, 128]"
        )


def _table(data: Mapping[str, object], key: str, what: str) -> Mapping[str, object]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise CampaignError(key, shown(value), f"use a table {what}")
    return value


def _tables(data: Mapping[str, object], key: str) -> list[Mapping[str, object]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise CampaignError(key, shown(value), f"use [[{key}]] tables")
    return value


def _int(t: Mapping[str, object], key: str, lo: int, hi: int) -> int | None:
    value = t.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CampaignError(f"limits.{key}", value, f"use an integer from {lo} to {hi}")
    return value


def _limits(t: Mapping[str, object]) -> CampaignLimits:
    for key in t:
        if key not in LIMIT_KEYS:
            raise CampaignError(
                f"limits.{key}", shown(t[key]), f"unknown key; allowed: {', '.join(LIMIT_KEYS)}"
            )
    fraction = t.get("canary_stop_fraction", 0.5)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, int | float)
        or not 0.0 <= fraction <= 1.0
    ):
        raise CampaignError(
            "limits.canary_stop_fraction",
            fraction,
            "use a share from 0 (stop at the first failed canary) to 1 (never stop)",
        )
    return CampaignLimits(
        max_jobs=_int(t, "max_jobs", 1, 1000) or 4,
        max_pending=_int(t, "max_pending", 1, 1000),
        max_nodes=_int(t, "max_nodes", 1, MAX_NODES * 1000),
        max_gpus=_int(t, "max_gpus", 1, MAX_GPUS),
        canary_stop_fraction=float(fraction),
    )


def _string(data: Mapping[str, object], key: str, *, required: bool) -> str | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or CONTROL_RE.search(value) or len(value) > 4096:
        raise CampaignError(key, shown(value), f"give {key} as a non-empty string")
    return value


def _name(fld: str, value: object) -> str:
    if not isinstance(value, str) or not CAMPAIGN_NAME_RE.fullmatch(value) or value in (".", ".."):
        raise CampaignError(
            fld,
            shown(value),
            "use 1 to 64 letters, digits and . _ - (not '.' or '..'), e.g. name = \"demo-sweep\"",
        )
    return value


def _axes(data: Mapping[str, object], check: _Keys) -> tuple[Axis, ...]:
    axes: list[Axis] = []
    for key, values in _table(data, "matrix", '[matrix] of "table.key" = [values]').items():
        fld = f"matrix.{key}"
        check.key(fld, key, values)
        if not isinstance(values, list) or not values:
            raise CampaignError(fld, shown(values), "give a non-empty list of values")
        for v in values:
            check.value(fld, key, v)
        axes.append(Axis((key,), tuple((v,) for v in values)))
    for i, z in enumerate(_tables(data, "zip")):
        if not z:
            raise CampaignError(f"zip[{i}]", {}, "give at least one key = [values]")
        lengths = set()
        for key, values in z.items():
            fld = f"zip[{i}].{key}"
            check.key(fld, key, values)
            if not isinstance(values, list) or not values:
                raise CampaignError(fld, shown(values), "give a non-empty list of values")
            for v in values:
                check.value(fld, key, v)
            lengths.add(len(values))
        if len(lengths) > 1:
            listed = ", ".join(f"{k} has {len(v)}" for k, v in z.items() if isinstance(v, list))
            raise CampaignError(
                f"zip[{i}]",
                f"lists of {sorted(lengths)} values",
                f"the keys of a zip vary together, so their lists need equal lengths ({listed})",
            )
        keys = tuple(z)
        columns = [z[k] for k in keys]
        assert all(isinstance(c, list) for c in columns)
        rows = tuple(zip(*(c for c in columns if isinstance(c, list)), strict=True))
        axes.append(Axis(keys, rows))
    seen: dict[str, str] = {}
    for axis in axes:
        for key in axis.keys:
            for target in _targets(key):
                if target in seen:
                    raise CampaignError(
                        key,
                        target,
                        f"{seen[target]} already sets {target}; give each field in one"
                        " [matrix] key or [[zip]] only",
                    )
                seen[target] = key
    return tuple(axes)


def _points(
    data: Mapping[str, object], section: str, axis_keys: Sequence[str], check: _Keys
) -> list[Values]:
    out: list[Values] = []
    tables = _tables(data, section)
    if section == "exclude" and len(tables) > MAX_EXCLUDES:
        raise CampaignError(
            "exclude",
            f"{len(tables)} tables",
            f"give at most {MAX_EXCLUDES} [[exclude]] tables; list only the values wanted in"
            " [matrix], or split the campaign",
        )
    for i, t in enumerate(tables):
        if section == "exclude" and not t:
            raise CampaignError(
                f"exclude[{i}]", {}, "an empty exclude would drop every point; give key = value"
            )
        for key, value in t.items():
            fld = f"{section}[{i}].{key}"
            check.key(fld, key, value)
            check.value(fld, key, value)
            if section == "exclude" and key not in axis_keys:
                raise CampaignError(
                    fld,
                    shown(value),
                    f"{key} is not a [matrix] or [[zip]] key, so no point could match;"
                    f" the keys are: {', '.join(axis_keys) or '(none)'}",
                )
        out.append(tuple(t.items()))
    return out


def parse_campaign(text: str, *, default_name: str) -> CampaignFile:
    """Parse and check a campaign file (TOML text); `default_name` (the file's stem) is
    its name when the file gives none. The base spec is not read here: see `expand`."""
    try:
        data = decode_toml(text)
    except CampaignError:
        raise
    except SpecError as exc:
        raise CampaignError(exc.field, exc.value, exc.hint) from None
    for key in data:
        if key not in CAMPAIGN_KEYS:
            raise CampaignError(
                key,
                shown(data[key]),
                f"unknown key; allowed at the top level: {', '.join(CAMPAIGN_KEYS)}",
            )
    name = _name("name", data["name"]) if "name" in data else _name("name", default_name)
    base = _string(data, "base", required=False)
    script = _string(data, "script", required=False)
    if base is not None and script is not None:
        raise CampaignError(
            "script",
            shown(script),
            "give base (a run spec to vary) or script (a batch script whose environment"
            " varies), not both",
        )
    launcher = None
    check = _Keys(_check_key, _check_value)
    if script is not None:
        launcher = script_campaign.parse_launcher(
            _table(data, "launcher", "[launcher] (a script campaign's settings)")
        )
        check = _Keys(functools.partial(_check_script_key, launcher=launcher), _any_value)
    elif base is None:
        raise CampaignError(
            "base",
            None,
            'give base = "spec.toml" (a run spec to vary) or script = "job.slurm" (a batch'
            " script whose environment varies, with a [launcher] table), relative to the"
            " campaign file",
        )
    elif "launcher" in data:
        raise CampaignError(
            "launcher",
            shown(data["launcher"]),
            'only a campaign over a batch script (script = "job.slurm") has a [launcher];'
            " remove it, or give script instead of base",
        )
    cluster = None if data.get("cluster") is None else _name("cluster", data["cluster"])
    axes = _axes(data, check)
    axis_keys = [k for a in axes for k in a.keys]
    excludes = tuple(_points(data, "exclude", axis_keys, check))
    includes = tuple(_points(data, "include", axis_keys, check))
    if launcher is not None:
        _check_topology_env(launcher, [*axis_keys, *(k for i in includes for k, _ in i)])
    return CampaignFile(
        name=name,
        base=base,
        cluster=cluster,
        limits=_limits(_table(data, "limits", "[limits]")),
        axes=axes,
        excludes=excludes,
        includes=includes,
        script=script,
        launcher=launcher,
        notify=_notify(_table(data, "notify", "[notify] (destinations = [...])")),
    )


def _notify(t: Mapping[str, object]) -> tuple[str, ...]:
    """The [notify] table's destination names (never a URL: `event_routing.parse_named`)."""
    for key in t:
        if key != "destinations":
            raise CampaignError(
                f"notify.{key}", shown(t[key]), "unknown key; allowed here: destinations"
            )
    try:
        return parse_named(t.get("destinations", []))
    except SpecError as exc:
        raise CampaignError(exc.field, exc.value, exc.hint) from None


def _check_script_key(fld: str, key: str, value: object, *, launcher: Launcher) -> None:
    script_campaign.check_key(fld, key, value, launcher)


def _any_value(fld: str, key: str, value: object) -> None:
    """A script campaign's values are checked per point (`campaign_script.point_of`)."""


def _check_topology_env(launcher: Launcher, keys: Sequence[str]) -> None:
    """Every name of launcher.topology_env is set by [launcher.env] or a matrix key."""
    known = {name for name, _ in launcher.env} | {
        k.removeprefix("env.") for k in keys if k.startswith("env.")
    }
    for name in launcher.topology_env:
        if name not in known:
            raise CampaignError(
                "launcher.topology_env",
                name,
                f"neither [launcher.env] nor a matrix key (env.{name}) sets it; set it there"
                " or remove it from topology_env",
            )


# --- expansion ----------------------------------------------------------------------------


def recipe_id(spec: RunSpec) -> str:
    """sha256 (hex) of ``{"fingerprint": recipe_fingerprint(spec), "schema": 1}`` as
    canonical JSON: the configuration a point measures, versioned so a change of what
    the fingerprint covers cannot make an old verified point look current."""
    doc = {"schema": RECIPE_ID_SCHEMA, "fingerprint": recipe_fingerprint(spec)}
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Variant:
    """One distinct combination: its matrix values, its spec (a script campaign's: its
    point) and that spec's recipe id."""

    values: Values
    spec: RunSpec | ScriptPoint
    spec_data: dict[str, object]  # the decoded base with `values` applied ({}: a script's)
    recipe_id: str

    @property
    def concurrencies(self) -> tuple[int, ...]:
        if isinstance(self.spec, ScriptPoint):
            return self.spec.concurrencies
        return self.spec.benchmark.concurrencies


@dataclass(frozen=True)
class Duplicate:
    """A combination that gave the recipe id and concurrencies of an earlier one."""

    values: Values
    same_as: Values


@dataclass(frozen=True)
class CampaignJob:
    """One Slurm job of the campaign: every point of one recipe id."""

    key: str  # the first 12 hex digits of recipe_id: stable across expansions
    recipe_id: str
    concurrencies: tuple[int, ...]  # sorted union over the job's variants
    spec_data: dict[str, object]  # what to submit (benchmark.concurrencies = the above)
    values: Values  # the first variant's matrix values, for display
    topology: str
    nodes: int
    gpus: int  # counted GPUs: counted_gpus_per_node x nodes (0: unknown)
    time_limit_s: int  # 0: unknown (a script's without --time)
    workload: int  # input_len + output_len: the canary is the cheapest (a script's: 0)
    # A script campaign's job: what it submits (`spec_data` is then empty).
    script_job: ScriptJob | None = None


@dataclass(frozen=True)
class Expansion:
    variants: tuple[Variant, ...]
    duplicates: tuple[Duplicate, ...]
    jobs: tuple[CampaignJob, ...]
    points_before_merge: int  # sum of every combination's concurrencies

    @property
    def points(self) -> int:
        """Distinct (recipe id, concurrency) points."""
        return sum(len(j.concurrencies) for j in self.jobs)

    @property
    def merged_points(self) -> int:
        """Points two combinations had in common, run once ("N duplicate points merged")."""
        return self.points_before_merge - self.points

    @property
    def node_hours_upper_bound(self) -> float:
        """Every job holding its nodes for its whole time limit."""
        return sum(j.nodes * j.time_limit_s for j in self.jobs) / 3600

    @property
    def gpu_hours_upper_bound(self) -> float:
        """Every job holding its counted GPUs for its whole time limit (0 for no GPUs)."""
        return sum(max(j.gpus, 0) * j.time_limit_s for j in self.jobs) / 3600


def _apply(data: dict[str, object], key: str, value: object, point: Values) -> None:
    """Set `key` (a dotted spec path, or the isl_osl alias) in `data`, making tables."""
    if key == ISL_OSL:
        assert isinstance(value, list)
        _apply(data, "benchmark.input_len", value[0], point)
        _apply(data, "benchmark.output_len", value[1], point)
        return
    *tables, last = key.split(".")
    table = data
    for i, name in enumerate(tables):
        sub = table.setdefault(name, {})
        if not isinstance(sub, dict):
            where = ".".join(tables[: i + 1])
            raise CampaignError(
                where,
                shown(sub),
                f"the base spec's {where} must be a table to set {key}",
                point=point,
            )
        table = sub
    table[last] = copy.deepcopy(value)


def _same(a: object, b: object) -> bool:
    """Equal as TOML values (1, 1.0 and true are three values)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@dataclass(frozen=True)
class PointLimit:
    """How many points an expansion may have: what the client asked for (``--max-points``;
    None: what the daemon allows), never more than the daemon's ``[limits]
    campaign_max_points`` (`daemon`; None: the client's bound alone)."""

    asked: int | None
    daemon: int | None = None

    def __post_init__(self) -> None:
        if self.asked is None and self.daemon is None:
            raise ValueError("a point limit needs the client's bound or the daemon's")

    @property
    def points(self) -> int:
        return min(b for b in (self.asked, self.daemon) if b is not None)

    def refusal(
        self, count: int, what: str = "points", verb: str = "expands to at least"
    ) -> CampaignError:
        """The error of a campaign of `count` `what`: it names the bound that refused it
        (the client's or the daemon's) and what to do."""
        if self.daemon is not None and (self.asked is None or self.asked >= self.daemon):
            allows = f"this daemon allows ([limits] campaign_max_points = {self.daemon}"
            fix = (
                "remove matrix values or split the campaign into smaller ones (the daemon's"
                " operator sets [limits] campaign_max_points)"
            )
        else:
            allows = f"--max-points allows ({self.points}"
            fix = "remove matrix values or raise --max-points"
            if self.daemon is not None:
                fix += f" (this daemon allows up to {self.daemon})"
        return CampaignError(
            "matrix",
            f"{count} {what}",
            f"the campaign {verb} {count} {what}, more than {allows}; points are (recipe,"
            f" concurrency) pairs counted before duplicates are merged); {fix}",
        )


def _limit(max_points: int | PointLimit) -> PointLimit:
    return max_points if isinstance(max_points, PointLimit) else PointLimit(max_points)


def combinations(campaign: CampaignFile) -> int:
    """How many combinations the campaign has at most, counted without building any: the
    product of its axes' lengths (a [[zip]] is one axis) and its includes (excludes can
    only make it fewer)."""
    return math.prod(len(a.rows) for a in campaign.axes) + len(campaign.includes)


Exclusion = tuple[tuple[int, frozenset[int]], ...]  # (axis index, its rows matched), ...


def _exclusions(campaign: CampaignFile) -> tuple[list[list[int]], list[Exclusion]]:
    """The rows of each axis that no exclude on that axis alone drops, and the excludes
    over two or more axes, each as the rows it matches per axis it names: a combination
    is excluded when its row of each of those axes is among them. A key an exclude names
    that every row of its axis matches constrains nothing; an exclude that no row
    matches is left out."""
    banned: list[set[int]] = [set() for _ in campaign.axes]
    multi: list[Exclusion] = []
    for exclude in campaign.excludes:
        want = dict(exclude)
        rows_of = []
        for ai, axis in enumerate(campaign.axes):
            named = [(ki, want[k]) for ki, k in enumerate(axis.keys) if k in want]
            if not named:
                continue
            rows = frozenset(
                ri for ri, row in enumerate(axis.rows) if all(_same(row[ki], v) for ki, v in named)
            )
            if len(rows) < len(axis.rows):
                rows_of.append((ai, rows))
        if any(not rows for _, rows in rows_of):
            continue  # matches no combination
        if not rows_of:  # matches every combination
            return [[] for _ in campaign.axes], []
        if len(rows_of) == 1:
            banned[rows_of[0][0]] |= rows_of[0][1]
        else:
            multi.append(tuple(rows_of))
    allowed = [
        [r for r in range(len(a.rows)) if r not in banned[ai]] for ai, a in enumerate(campaign.axes)
    ]
    return allowed, multi


def _stopped(campaign: CampaignFile, built: int) -> ExpansionStopped:
    return ExpansionStopped(campaign.name, built, combinations(campaign))


def _combinations(campaign: CampaignFile, limit: PointLimit, stop: Stop | None) -> list[Values]:
    """The matrix's combinations left after the excludes, then the includes (see
    `expand`); CampaignError when they are more than `limit` allows, ExpansionStopped
    once `stop()` is true."""
    max_points = limit.points
    raw = math.prod(len(a.rows) for a in campaign.axes)
    if raw > MAX_COMBINATIONS_PER_POINT * max_points:  # too many even to look at
        raise limit.refusal(raw, "combinations before excludes", "matrix has")
    allowed, multi = _exclusions(campaign)
    checks = math.prod(len(rows) for rows in allowed) * len(multi)
    if checks > MAX_EXCLUDE_CHECKS:
        raise CampaignError(
            "exclude",
            f"{len(multi)} tables",
            f"the {len(multi)} [[exclude]] tables over two or more keys would each be checked"
            f" against {checks // len(multi)} combinations, more than this daemon checks for"
            f" one campaign ({MAX_EXCLUDE_CHECKS} checks); list only the values wanted in"
            " [matrix], exclude values of one key at a time, or split the campaign",
        )
    points: list[Values] = []
    for n, pick in enumerate(itertools.product(*allowed)):
        if n % _STOP_EVERY == 0 and stop is not None and stop():
            raise _stopped(campaign, 0)
        if multi and any(all(pick[ai] in rows for ai, rows in ex) for ex in multi):
            continue
        points.append(
            tuple(
                pair
                for axis, ri in zip(campaign.axes, pick, strict=True)
                for pair in zip(axis.keys, axis.rows[ri], strict=True)
            )
        )
        if len(points) + len(campaign.includes) > max_points:  # each has a concurrency
            raise limit.refusal(len(points) + len(campaign.includes))
    return points + list(campaign.includes)


class _Merge:
    """Variants and duplicates as combinations come, counting points before the merge."""

    def __init__(self, limit: PointLimit) -> None:
        self.limit = limit
        self.variants: list[Variant] = []
        self.duplicates: list[Duplicate] = []
        self.seen: dict[tuple[str, tuple[int, ...]], Values] = {}
        self.before = 0

    def add(self, variant: Variant) -> None:
        self.before += len(variant.concurrencies)
        if self.before > self.limit.points:
            raise self.limit.refusal(self.before)
        ident = (variant.recipe_id, tuple(sorted(variant.concurrencies)))
        if ident in self.seen:
            self.duplicates.append(Duplicate(variant.values, self.seen[ident]))
            return
        self.seen[ident] = variant.values
        self.variants.append(variant)


def expand(
    campaign: CampaignFile,
    base: Mapping[str, object],
    *,
    max_points: int | PointLimit = MAX_POINTS,
    stop: Stop | None = None,
) -> Expansion:
    """The campaign's variants and jobs over the decoded base spec `base`.

    Combinations come in a fixed order: the [matrix] keys in file order (the last key
    varying fastest), the [[zip]] dimensions after them, then the includes. Excluded
    combinations are dropped; a combination with the recipe id and concurrencies of an
    earlier one is a duplicate of it. Points are counted before duplicates are merged;
    more than `max_points` is refused: as soon as the combinations left after the
    excludes (each has at least one concurrency) are too many, before any spec is
    built, else once their concurrencies are known. A matrix of more than
    ``MAX_COMBINATIONS_PER_POINT`` x `max_points` combinations is refused unexamined.
    `max_points` is the client's bound, or a `PointLimit` (the client's and the daemon's).

    `stop` is asked between combinations (every few thousand while they are counted,
    before each spec is built): once it is true, ExpansionStopped. ValueError for a
    script campaign (`expand_script`).
    """
    if campaign.launcher is not None:
        raise ValueError(f"campaign {campaign.name} is over a script: use expand_script")
    limit = _limit(max_points)
    merge = _Merge(limit)
    for built, values in enumerate(_combinations(campaign, limit, stop)):
        if stop is not None and stop():
            raise _stopped(campaign, built)
        data = copy.deepcopy(dict(base))
        for key, value in values:
            _apply(data, key, value, values)
        try:
            spec = parse_spec(data)
        except SpecError as exc:
            raise CampaignError(exc.field, exc.value, exc.hint, point=values) from None
        merge.add(Variant(values, spec, data, recipe_id(spec)))
    return Expansion(
        tuple(merge.variants), tuple(merge.duplicates), _jobs(merge.variants), merge.before
    )


# The `submit --script` options a campaign's launcher fields stand for.
_LAUNCHER_FIELD: Final = {
    "--log-dir": "launcher.log_dir",
    "--chdir": "launcher.chdir",
    "--logs": "launcher.logs",
    "--marker": "launcher.marker",
    "--marker-format": "launcher.marker_format",
    "--results": "launcher.results",
    "--job-name-prefix": "launcher.job_name_prefix",
    "--prefill-gpus": "launcher.prefill_gpus",
    "--decode-gpus": "launcher.decode_gpus",
    "SBATCH-ARGS": "launcher.sbatch_args",
    "--export-env": "launcher.env",
}


def expand_script(
    campaign: CampaignFile,
    script: str,
    *,
    script_name: str,
    campaign_dir: str,
    max_points: int | PointLimit = MAX_POINTS,
    stop: Stop | None = None,
) -> Expansion:
    """A script campaign's variants and jobs, as `expand` makes a run spec campaign's:
    `script` is the batch script's text (`script_name` its file name), `campaign_dir` the
    campaign file's absolute directory (the launcher's paths are relative to it).

    The first job's `submit --script` spec is checked as `submit --script` checks one
    (the script's first line and #SBATCH lines too); an error names the launcher field.
    `stop` as for `expand`. ValueError for a run spec campaign (`expand`).
    """
    launcher = campaign.launcher
    if launcher is None:
        raise ValueError(f"campaign {campaign.name} is over a run spec: use expand")
    if not campaign_dir.startswith("/"):
        raise CampaignError(
            "script",
            shown(campaign_dir),
            "the campaign file's directory must be known as an absolute path (the launcher's"
            " paths are relative to it); submit it with this version's client",
        )
    digest = hashlib.sha256(script.encode("utf-8")).hexdigest()
    limit = _limit(max_points)
    merge = _Merge(limit)
    for built, values in enumerate(_combinations(campaign, limit, stop)):
        if stop is not None and stop():
            raise _stopped(campaign, built)
        point = script_campaign.point_of(launcher, values)
        merge.add(
            Variant(values, point, {}, script_campaign.script_recipe_id(digest, launcher, point))
        )
    time_limit_s = script_campaign.time_limit_of(launcher.sbatch_args, script)
    groups: dict[str, list[Variant]] = {}
    for v in merge.variants:
        groups.setdefault(v.recipe_id, []).append(v)
    jobs = []
    for rid, group in groups.items():
        first = group[0].spec
        assert isinstance(first, ScriptPoint)
        job = script_campaign.script_job(
            launcher,
            first,
            script_name=script_name,
            script_sha256=digest,
            campaign_dir=campaign_dir,
            values=group[0].values,
        )
        concs = tuple(sorted({c for v in group for c in v.concurrencies}))
        jobs.append(
            CampaignJob(
                key=rid[:12],
                recipe_id=rid,
                concurrencies=concs,
                spec_data={},
                values=group[0].values,
                topology=script_campaign.topology_of(launcher, first),
                nodes=first.nodes,
                gpus=first.nodes * first.gpus_per_node,
                time_limit_s=time_limit_s,
                workload=0,
                script_job=job,
            )
        )
    if jobs:
        _check_as_submitted(jobs[0], script)
    return Expansion(tuple(merge.variants), tuple(merge.duplicates), tuple(jobs), merge.before)


def _check_as_submitted(job: CampaignJob, script: str) -> None:
    """`job`'s run spec passes `submit --script`'s checks (CampaignError naming the
    launcher field, or the script)."""
    assert job.script_job is not None
    text = job.script_job.foreign_json(script, {}, job.concurrencies)
    try:
        foreign_spec.load(text)
    except SpecError as exc:
        fld = "script" if exc.field == "--script" else _LAUNCHER_FIELD.get(exc.field, exc.field)
        raise CampaignError(fld, exc.value, exc.hint) from None


def _jobs(variants: Sequence[Variant]) -> tuple[CampaignJob, ...]:
    """One job per recipe id, in the order of its first variant."""
    groups: dict[str, list[Variant]] = {}
    for v in variants:
        groups.setdefault(v.recipe_id, []).append(v)
    jobs = []
    for rid, group in groups.items():
        first = group[0]
        spec = first.spec
        assert isinstance(spec, RunSpec)
        concs = tuple(sorted({c for v in group for c in v.concurrencies}))
        jobs.append(
            CampaignJob(
                key=rid[:12],
                recipe_id=rid,
                concurrencies=concs,
                spec_data=_with_concurrencies(first.spec_data, concs),
                values=first.values,
                topology=topology_key(spec),
                nodes=spec.topology.nodes,
                gpus=spec.topology.counted_gpus_per_node * spec.topology.nodes,
                time_limit_s=spec.slurm.time_limit_s,
                workload=spec.benchmark.input_len + spec.benchmark.output_len,
            )
        )
    return tuple(jobs)


def _with_concurrencies(data: Mapping[str, object], concs: Sequence[int]) -> dict[str, object]:
    out = copy.deepcopy(dict(data))
    bench = out["benchmark"]
    assert isinstance(bench, dict)
    bench["concurrencies"] = list(concs)
    return out


def job_text(job: CampaignJob) -> str:
    """What the journal keeps as the job's spec: a run spec's TOML, or a script job's JSON
    (`campaign_script.is_script_job` tells them apart)."""
    return job.script_job.to_json() if job.script_job is not None else dump_toml(job.spec_data)


def job_spec(job: CampaignJob, concurrencies: Sequence[int]) -> dict[str, object]:
    """`job`'s spec dict running only `concurrencies` (its points not verified yet).

    ValueError when `concurrencies` is empty or has one the job does not run (or the job
    is a script campaign's: its runs are `ScriptJob.foreign_json`).
    """
    if job.script_job is not None:
        raise ValueError(f"job {job.key} runs a batch script, not a run spec")
    extra = sorted(set(concurrencies) - set(job.concurrencies))
    if not concurrencies or extra:
        raise ValueError(
            f"job {job.key} runs concurrencies {list(job.concurrencies)}; asked for"
            f" {list(concurrencies)}"
        )
    return _with_concurrencies(job.spec_data, sorted(set(concurrencies)))
