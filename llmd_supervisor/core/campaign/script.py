"""A campaign over a user's own batch script (pure, no I/O; DESIGN.md §12).

A campaign file with ``script`` instead of ``base`` varies the environment of that script,
the way InferenceX's ``submit.sh`` hands its settings to ``job.slurm``::

    script = "job.slurm"             # the batch script, relative to this file
    [launcher]                       # what `submit --script` takes, and what a campaign needs
    chdir = "."                      # sbatch's working directory (default: this file's)
    log_dir = "."                    # below it: logs, marker, results (default: chdir)
    logs = ["slurm_job-{job_id}_rank_*.log"]
    marker = ".bench_done.{job_id}"
    marker_format = "int"            # json | int | none (default: json with a marker)
    results = ["results/*.json"]
    job_name_prefix = "ix"
    sbatch_args = ["--partition=gpu", "--time=02:00:00"]   # as after `submit --script ... --`
    prefill_gpus = 8                 # with decode_gpus: the roles' GPUs (per-GPU numbers)
    decode_gpus = 8
    nodes = 2                        # required: passed to sbatch as --nodes; admission counts it
    gpus_per_node = 8                # counted (max_gpus, GPU-hours), not requested; default 0
    concurrency_env = "BENCH_MAX_CONCURRENCY"   # required: the variable of a job's concurrencies
    concurrency_separator = "x"      # "1x4x16", as InferenceX's server.sh splits them
    concurrencies = [1, 4, 16]
    topology_env = ["PREFILL_NODES", "DECODE_NODES"]   # part of the canary's topology key
    [launcher.env]                   # NAME = a string, integer, float or boolean
    MODEL_NAME = "deepseek-ai/DeepSeek-R1"
    [matrix]
    "env.BENCH_INPUT_LEN" = [1024, 8192]
    "launcher.nodes" = [2, 4]

``chdir`` and ``log_dir`` are relative to the campaign file. Matrix, zip, exclude and include
keys are ``env.<NAME>``, ``launcher.nodes``, ``launcher.gpus_per_node`` and
``launcher.concurrencies`` (a list of integer lists). A point's environment is
``[launcher.env]`` with its ``env.<NAME>`` values over it, each as the script reads it
(`env_text`: ``true``/``false`` for booleans). Names must be shell names that the submit
path exports (`foreign_spec.env_refused`: not ``SBATCH_*`` either, which sbatch would read
as its options) and not ``concurrency_env``: a job's run gets that variable, its concurrencies
joined by the separator.

Every job runs in the one ``chdir``: ``{env.NAME}`` in a ``logs`` or ``results`` pattern
stands for the job's value of NAME, so that each job's patterns match its own files
(``results = ["logs/{env.RESULT_FILENAME}_c*.json"]``), as ``{job_id}`` does.

The recipe id (`script_recipe_id`) hashes the script's sha256, the environment, the nodes,
the GPUs and the sbatch options, leaving out names, partition, account, QOS, time limit and
output files. A job is journaled as a `ScriptJob` (JSON); its run's `submit --script` spec
is `ScriptJob.foreign_json`.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypedDict

from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.core.spec.fields import CONTROL_RE, shown
from llmd_supervisor.core.spec.foreign import ENV_NAME_RE, check_pattern
from llmd_supervisor.core.spec.runspec import MAX_NODES
from llmd_supervisor.core.spec.slurm_table import time_limit_seconds
from llmd_supervisor.errors import CampaignError, SpecError

__all__ = [
    "LAUNCHER_KEYS",
    "SCRIPT_KEYS",
    "SCRIPT_RECIPE_SCHEMA",
    "Launcher",
    "ScriptJob",
    "ScriptJobJson",
    "ScriptPoint",
    "check_key",
    "env_text",
    "is_script_job",
    "parse_launcher",
    "point_of",
    "recipe_sbatch_args",
    "script_job",
    "script_recipe_id",
    "time_limit_of",
    "topology_of",
]

LAUNCHER_KEYS: Final = (
    "chdir", "log_dir", "logs", "marker", "marker_format", "results", "job_name_prefix",
    "sbatch_args", "prefill_gpus", "decode_gpus", "nodes", "gpus_per_node", "concurrency_env",
    "concurrency_separator", "concurrencies", "topology_env", "env",
)  # fmt: skip
SCRIPT_KEYS: Final = ("launcher.nodes", "launcher.gpus_per_node", "launcher.concurrencies")
SCRIPT_RECIPE_SCHEMA: Final = 1
SCRIPT_JOB_VERSION: Final = 1
MAX_GPUS_PER_NODE: Final = 64  # as topology.gpus_per_node
MAX_CONCURRENCY: Final = 100_000  # as benchmark.concurrencies
TOPOLOGY_ENV_MAX: Final = 16
ENV_VALUE_MAX: Final = 32 * 1024
SUBJECT: Final = "Launcher"  # a point's errors name a launcher field, not a run spec's
_ENV_PLACEHOLDER: Final = re.compile(r"\{env\.([^{}]*)\}")  # in logs and results patterns
# sbatch options that change where, how long or under which name a job runs, not what it
# measures: left out of the recipe id (long names, then their short letters).
_NOT_RECIPE_LONG: Final = (
    "--job-name", "--partition", "--account", "--qos", "--time", "--output", "--error",
)  # fmt: skip
_NOT_RECIPE_SHORT: Final = ("-J", "-p", "-A", "-q", "-t", "-o", "-e")

Values = tuple[tuple[str, object], ...]


# --- the [launcher] table -----------------------------------------------------------------


@dataclass(frozen=True)
class Launcher:
    """A script campaign's ``[launcher]``, checked; paths as written (see `script_job`)."""

    nodes: int
    concurrency_env: str
    gpus_per_node: int = 0
    concurrency_separator: str = "x"
    concurrencies: tuple[int, ...] | None = None  # None: every point's matrix gives them
    topology_env: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # [launcher.env], as the script reads the values
    chdir: str | None = None  # relative to the campaign file; None: its directory
    log_dir: str | None = None  # relative to the campaign file; None: chdir
    logs: tuple[str, ...] = ()
    marker: str | None = None
    marker_format: str = "none"
    results: tuple[str, ...] = ()
    job_name_prefix: str | None = None
    sbatch_args: tuple[str, ...] = ()  # as `check_sbatch_args` joins them; no --nodes
    prefill_gpus: int | None = None
    decode_gpus: int | None = None


def _fld(key: str) -> str:
    return f"launcher.{key}"


def _as_campaign(fld: str, exc: SpecError) -> CampaignError:
    """A `submit --script` check's refusal, naming the launcher field that was checked."""
    return CampaignError(fld, exc.value, exc.hint)


def _text(t: Mapping[str, object], key: str, *, required: bool = False) -> str | None:
    value = t.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or CONTROL_RE.search(value) or len(value) > 4096:
        raise CampaignError(_fld(key), shown(value), f"give launcher.{key} as a non-empty string")
    return value


def _int(fld: str, value: object, lo: int, hi: int, point: Values | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CampaignError(
            fld, shown(value), f"use an integer from {lo} to {hi}", point=point, subject=SUBJECT
        )
    return value


def _strings(t: Mapping[str, object], key: str) -> list[str]:
    value = t.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CampaignError(_fld(key), shown(value), 'use a list of strings, e.g. ["a", "b"]')
    return value


def _patterns(t: Mapping[str, object], key: str) -> tuple[str, ...]:
    """`logs` or `results`: patterns as `submit --script` takes them, where ``{env.NAME}``
    stands for the job's variable NAME (checked with each job's values: `script_job`)."""
    found = _strings(t, key)
    if len(found) > foreign_spec.PATTERNS_MAX:
        raise CampaignError(
            _fld(key), shown(found), f"give at most {foreign_spec.PATTERNS_MAX} patterns"
        )
    for pattern in found:
        for name in _ENV_PLACEHOLDER.findall(pattern):
            if not ENV_NAME_RE.fullmatch(name):
                raise CampaignError(
                    _fld(key), pattern, f"{{env.{name}}} does not name a variable: {{env.NAME}}"
                )
        try:
            check_pattern(f"--{key}", _ENV_PLACEHOLDER.sub("x", pattern))
        except SpecError as exc:
            raise _as_campaign(_fld(key), exc) from None
    return tuple(found)


def _with_env(
    key: str, patterns: Sequence[str], env: Mapping[str, str], point: Values
) -> tuple[str, ...]:
    """`patterns` with each ``{env.NAME}`` replaced by the job's value of NAME."""

    def value(m: re.Match[str]) -> str:
        if m.group(1) not in env:
            raise CampaignError(
                _fld(key),
                m.group(0),
                f"the job has no variable {m.group(1)}; set it in [launcher.env] or the matrix",
                point=point,
                subject=SUBJECT,
            )
        return env[m.group(1)]

    out = []
    for pattern in patterns:
        done = _ENV_PLACEHOLDER.sub(value, pattern)
        try:
            check_pattern(f"--{key}", done)
        except SpecError as exc:
            why = f"with the job's variables it is {done!r}: {exc.hint}"
            raise CampaignError(_fld(key), pattern, why, point=point, subject=SUBJECT) from None
        out.append(done)
    return tuple(out)


def concurrencies_of(fld: str, value: object, point: Values | None = None) -> tuple[int, ...]:
    """A list of distinct concurrencies (CampaignError naming `fld` and `point`)."""
    if not isinstance(value, list) or not value:
        raise CampaignError(
            fld,
            shown(value),
            "list at least one concurrency, e.g. [1, 4, 16]",
            point=point,
            subject=SUBJECT,
        )
    concs = [_int(fld, c, 1, MAX_CONCURRENCY, point) for c in value]
    if len(set(concs)) != len(concs):
        raise CampaignError(
            fld, shown(value), "remove the duplicate concurrencies", point=point, subject=SUBJECT
        )
    return tuple(concs)


def env_text(fld: str, value: object, point: Values | None = None) -> str:
    """A TOML value as the script reads it: a string as it is, an integer or float in
    Python's spelling (``0.8``, ``inf``), a boolean as ``true``/``false``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if not isinstance(value, str) or "\0" in value or len(value) > ENV_VALUE_MAX:
        raise CampaignError(
            fld,
            shown(value),
            f"give a string (at most {ENV_VALUE_MAX} bytes, no NUL), an integer, a float or"
            " a boolean",
            point=point,
            subject=SUBJECT,
        )
    return value


def check_env_name(fld: str, name: str, concurrency_env: str | None) -> None:
    """`name` may be set in a script campaign's environment (CampaignError if not)."""
    if not ENV_NAME_RE.fullmatch(name):
        raise CampaignError(
            fld,
            name,
            "use a shell variable name: letters, digits and _, not starting with a digit"
            " (at most 128)",
        )
    if foreign_spec.env_refused(name):
        if name.startswith(foreign_spec.SBATCH_ENV_PREFIX):
            why = "sbatch reads SBATCH_* as its own options; give them in launcher.sbatch_args"
        else:
            why = (
                "submit --script never exports this variable (it would change what sbatch"
                " executes or how it names, places or exports the job); set it in the script"
            )
        raise CampaignError(fld, name, why)
    if name == concurrency_env:
        raise CampaignError(
            fld,
            name,
            "it carries a job's concurrencies (launcher.concurrency_env);"
            " give launcher.concurrencies or vary it in [matrix]",
        )


def _sbatch_args(t: Mapping[str, object]) -> tuple[str, ...]:
    try:
        args = foreign_spec.check_sbatch_args(t.get("sbatch_args", []))
    except SpecError as exc:
        raise _as_campaign(_fld("sbatch_args"), exc) from None
    for arg in args:
        name = arg.split("=", 1)[0]
        if arg.startswith("-N") or (len(name) >= 6 and "--nodes".startswith(name)):
            raise CampaignError(
                _fld("sbatch_args"),
                arg,
                "set launcher.nodes instead: the daemon passes it to sbatch as --nodes and"
                " admission counts it",
            )
    return args


def _marker(t: Mapping[str, object]) -> tuple[str | None, str]:
    marker = _text(t, "marker")
    if marker is not None:
        try:
            foreign_spec.check_marker(marker)
        except SpecError as exc:
            raise _as_campaign(_fld("marker"), exc) from None
    fmt = t.get("marker_format", "json" if marker else "none")
    if fmt not in ("json", "int", "none"):
        raise CampaignError(
            _fld("marker_format"),
            shown(fmt),
            "use json (this project's protocol), int (the rc and a newline, InferenceX) or"
            " none (Slurm's evidence alone)",
        )
    assert isinstance(fmt, str)
    return marker, fmt


def parse_launcher(t: Mapping[str, object]) -> Launcher:
    """A script campaign's ``[launcher]`` table, checked (CampaignError naming the key)."""
    for key in t:
        if key not in LAUNCHER_KEYS:
            raise CampaignError(
                _fld(key), shown(t[key]), f"unknown key; allowed: {', '.join(LAUNCHER_KEYS)}"
            )
    for key in ("nodes", "concurrency_env"):
        if key not in t:
            raise CampaignError(
                _fld(key),
                None,
                "a script campaign needs launcher.nodes (the nodes of each job) and"
                " launcher.concurrency_env (the variable of its concurrencies, e.g."
                ' "BENCH_MAX_CONCURRENCY")',
            )
    conc_env = _text(t, "concurrency_env", required=True)
    assert conc_env is not None
    check_env_name(_fld("concurrency_env"), conc_env, None)
    separator = t.get("concurrency_separator", "x")
    if (
        not isinstance(separator, str)
        or not 1 <= len(separator) <= 8
        or CONTROL_RE.search(separator)
        or any(ch.isdigit() for ch in separator)
    ):
        raise CampaignError(
            _fld("concurrency_separator"),
            shown(separator),
            'use 1 to 8 characters, no digits, e.g. "x" (InferenceX: 1x4x16) or ","',
        )
    env = t.get("env", {})
    if not isinstance(env, Mapping):
        raise CampaignError(_fld("env"), shown(env), "use a table [launcher.env] of NAME = value")
    if len(env) > foreign_spec.ENV_MAX_VARS:
        raise CampaignError(
            _fld("env"), f"{len(env)} variables", f"give at most {foreign_spec.ENV_MAX_VARS}"
        )
    for name in env:
        check_env_name(f"launcher.env.{name}", name, conc_env)
    topology_env = _strings(t, "topology_env")
    if len(topology_env) > TOPOLOGY_ENV_MAX:
        raise CampaignError(
            _fld("topology_env"), shown(topology_env), f"name at most {TOPOLOGY_ENV_MAX} variables"
        )
    for name in topology_env:
        check_env_name(_fld("topology_env"), name, conc_env)
    marker, fmt = _marker(t)
    prefix = _text(t, "job_name_prefix")
    try:
        if prefix is not None:
            foreign_spec.check_job_name_prefix(prefix)
        prefill, decode = foreign_spec.check_role_gpus(t.get("prefill_gpus"), t.get("decode_gpus"))
    except SpecError as exc:  # --job-name-prefix, --prefill-gpus, --decode-gpus
        raise _as_campaign(_fld(exc.field.removeprefix("--").replace("-", "_")), exc) from None
    concs = t.get("concurrencies")
    return Launcher(
        nodes=_int(_fld("nodes"), t["nodes"], 1, MAX_NODES),
        concurrency_env=conc_env,
        gpus_per_node=_int(_fld("gpus_per_node"), t.get("gpus_per_node", 0), 0, MAX_GPUS_PER_NODE),
        concurrency_separator=separator,
        concurrencies=None if concs is None else concurrencies_of(_fld("concurrencies"), concs),
        topology_env=tuple(topology_env),
        env=tuple((k, env_text(f"launcher.env.{k}", v)) for k, v in env.items()),
        chdir=_text(t, "chdir"),
        log_dir=_text(t, "log_dir"),
        logs=_patterns(t, "logs"),
        marker=marker,
        marker_format=fmt,
        results=_patterns(t, "results"),
        job_name_prefix=prefix,
        sbatch_args=_sbatch_args(t),
        prefill_gpus=prefill,
        decode_gpus=decode,
    )


def valid_keys() -> str:
    """The keys a script campaign's matrix may set, for the error naming an unknown one."""
    return "env.<NAME>; " + "; ".join(SCRIPT_KEYS)


def check_key(fld: str, key: str, value: object, launcher: Launcher) -> None:
    """`key` is one a script campaign's [matrix], [[zip]], [[exclude]] or [[include]] may
    set (its value is checked per point: `point_of`)."""
    if key.startswith("env."):
        check_env_name(fld, key.removeprefix("env."), launcher.concurrency_env)
        return
    if key not in SCRIPT_KEYS:
        raise CampaignError(
            fld, key, f"not a key a script campaign can set; use one of: {valid_keys()}"
        )


# --- a point --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScriptPoint:
    """One combination of a script campaign: what its job runs with."""

    env: tuple[tuple[str, str], ...]  # [launcher.env] with the point's env.<NAME> over it
    nodes: int
    gpus_per_node: int
    concurrencies: tuple[int, ...]


def point_of(launcher: Launcher, values: Values) -> ScriptPoint:
    """The point `values` (matrix key, value) make of `launcher`; CampaignError naming the
    point and the field when a value is not one the key takes."""
    env = dict(launcher.env)
    nodes, gpus, concs = launcher.nodes, launcher.gpus_per_node, launcher.concurrencies
    for key, value in values:
        if key.startswith("env."):
            env[key.removeprefix("env.")] = env_text(key, value, values)
        elif key == "launcher.nodes":
            nodes = _int(key, value, 1, MAX_NODES, values)
        elif key == "launcher.gpus_per_node":
            gpus = _int(key, value, 0, MAX_GPUS_PER_NODE, values)
        elif key == "launcher.concurrencies":
            concs = concurrencies_of(key, value, values)
    if concs is None:
        raise CampaignError(
            "launcher.concurrencies",
            None,
            "give launcher.concurrencies = [...] or vary launcher.concurrencies in [matrix]",
            point=values,
            subject=SUBJECT,
        )
    with_concs = {**env, launcher.concurrency_env: concurrency_text(launcher, concs)}
    size = foreign_spec.env_bytes(with_concs)
    if size > foreign_spec.ENV_MAX_BYTES:
        raise CampaignError(
            "launcher.env",
            f"{size} bytes",
            f"a job's environment is at most {foreign_spec.ENV_MAX_BYTES} bytes",
            point=values,
            subject=SUBJECT,
        )
    return ScriptPoint(tuple(env.items()), nodes, gpus, concs)


def concurrency_text(launcher: Launcher, concurrencies: Sequence[int]) -> str:
    """The value of `concurrency_env`: the concurrencies, ascending, joined (``1x4x16``)."""
    return launcher.concurrency_separator.join(str(c) for c in sorted(concurrencies))


def topology_of(launcher: Launcher, point: ScriptPoint) -> str:
    """``"2N/8gpn"``: the point's nodes and counted GPUs per node, then the values of
    `topology_env` (``"2N/8gpn/PREFILL_NODES=1,DECODE_NODES=1"``)."""
    key = f"{point.nodes}N/{point.gpus_per_node}gpn"
    env = dict(point.env)
    if launcher.topology_env:
        key += "/" + ",".join(f"{name}={env.get(name, '')}" for name in launcher.topology_env)
    return key


def recipe_sbatch_args(args: Sequence[str]) -> list[str]:
    """The sbatch options that define the configuration: all but the job's name,
    partition, account, QOS, time limit and output files."""

    def ignored(arg: str) -> bool:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            return any(len(name) >= 5 and long.startswith(name) for long in _NOT_RECIPE_LONG)
        return arg[:2] in _NOT_RECIPE_SHORT

    return [a for a in args if not ignored(a)]


def script_recipe_id(script_sha256: str, launcher: Launcher, point: ScriptPoint) -> str:
    """sha256 (hex) of the canonical JSON of what a script job measures: the script's
    sha256, its environment (not the concurrencies' variable), nodes, GPUs per node, the
    roles' GPUs and the sbatch options that define the configuration; versioned."""
    doc = {
        "schema": SCRIPT_RECIPE_SCHEMA,
        "kind": "script",
        "script_sha256": script_sha256,
        "env": dict(point.env),
        "nodes": point.nodes,
        "gpus_per_node": point.gpus_per_node,
        "prefill_gpus": launcher.prefill_gpus,
        "decode_gpus": launcher.decode_gpus,
        "sbatch_args": recipe_sbatch_args(launcher.sbatch_args),
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _time_words(script: str) -> list[str]:
    """The words of the script's ``#SBATCH`` lines that sbatch reads."""
    words: list[str] = []
    for line in script.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break  # sbatch stops reading directives at the first command
        if stripped.startswith("#SBATCH"):
            for word in stripped.removeprefix("#SBATCH").split():
                if word.startswith("#"):
                    break
                words.append(word)
    return words


def time_limit_of(sbatch_args: Sequence[str], script: str) -> int:
    """The job's time limit in seconds: the last ``--time``/``-t`` of `sbatch_args`, else
    of the script's directives; 0 when neither says (or says UNLIMITED)."""
    found: str | None = None
    words = _time_words(script)
    for i, word in enumerate(words):  # the script's: -t VALUE / --time VALUE / joined
        if word in ("-t", "--time") and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith("--time="):
            found = word.removeprefix("--time=")
        elif word.startswith("-t") and len(word) > 2:
            found = word[2:]
    for arg in sbatch_args:  # joined by check_sbatch_args; the command line wins
        if arg.startswith("--time="):
            found = arg.removeprefix("--time=")
        elif arg.startswith("-t") and len(arg) > 2:
            found = arg[2:]
    if found is None:
        return 0
    try:
        return time_limit_seconds(found)
    except SpecError:
        return 0


# --- the journaled job ----------------------------------------------------------------------


class ScriptJobJson(TypedDict):
    """A `ScriptJob` as `ScriptJob.to_json` journals it (under ``"script_job"``, as the
    job's spec) and `ScriptJob.from_json` reads it back, checking every field."""

    v: int  # SCRIPT_JOB_VERSION
    script_name: str
    script_sha256: str
    chdir: str
    log_dir: str
    logs: list[str]
    marker: str | None
    marker_format: str
    results: list[str]
    job_name_prefix: str | None
    sbatch_args: list[str]
    prefill_gpus: int | None
    decode_gpus: int | None
    env: list[list[str]]  # [name, value] pairs, in order
    concurrency_env: str
    concurrency_separator: str


@dataclass(frozen=True)
class ScriptJob:
    """What a script campaign's job submits, but the script's text (kept once, with the
    campaign) and the environment it is submitted from. Journaled as the job's spec
    (`to_json`); `foreign_json` is its run's `submit --script` spec."""

    script_name: str
    script_sha256: str
    chdir: str  # absolute
    log_dir: str  # absolute
    logs: tuple[str, ...]
    marker: str | None
    marker_format: str
    results: tuple[str, ...]
    job_name_prefix: str | None
    sbatch_args: tuple[str, ...]  # --nodes first, then the launcher's
    prefill_gpus: int | None
    decode_gpus: int | None
    env: tuple[tuple[str, str], ...]  # the point's environment (not the concurrencies')
    concurrency_env: str
    concurrency_separator: str

    def env_of(self, concurrencies: Sequence[int]) -> dict[str, str]:
        """The variables the job's run gets from the campaign when it runs `concurrencies`."""
        joined = self.concurrency_separator.join(str(c) for c in sorted(concurrencies))
        return {**dict(self.env), self.concurrency_env: joined}

    def foreign_json(
        self, script: str, base_env: Mapping[str, str], concurrencies: Sequence[int]
    ) -> str:
        """The `submit --script` spec (JSON) of the run of `concurrencies`: `base_env` (the
        client's exported environment, or what a job gets of the daemon's) with the job's
        variables over it. ValueError when `script` is not the script the job was planned
        with."""
        digest = hashlib.sha256(script.encode("utf-8")).hexdigest()
        if digest != self.script_sha256:
            raise ValueError(
                f"the campaign's script has sha256 {digest}, its job was planned with"
                f" {self.script_sha256}"
            )
        body = {
            "kind": "script",
            "log_dir": self.log_dir,
            "logs": list(self.logs),
            "marker": self.marker,
            "marker_format": self.marker_format,
            "results": list(self.results),
            "script": script,
            "script_name": self.script_name,
            "chdir": self.chdir,
            "env": {**dict(base_env), **self.env_of(concurrencies)},
            "sbatch_args": list(self.sbatch_args),
            "job_name_prefix": self.job_name_prefix,
            "prefill_gpus": self.prefill_gpus,
            "decode_gpus": self.decode_gpus,
        }
        return json.dumps({"foreign": body}, sort_keys=True)

    def to_json(self) -> str:
        body: ScriptJobJson = {
            "v": SCRIPT_JOB_VERSION,
            "script_name": self.script_name,
            "script_sha256": self.script_sha256,
            "chdir": self.chdir,
            "log_dir": self.log_dir,
            "logs": list(self.logs),
            "marker": self.marker,
            "marker_format": self.marker_format,
            "results": list(self.results),
            "job_name_prefix": self.job_name_prefix,
            "sbatch_args": list(self.sbatch_args),
            "prefill_gpus": self.prefill_gpus,
            "decode_gpus": self.decode_gpus,
            "env": [[k, v] for k, v in self.env],
            "concurrency_env": self.concurrency_env,
            "concurrency_separator": self.concurrency_separator,
        }
        return json.dumps({"script_job": body}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ScriptJob:
        """A job as `to_json` wrote it; SpecError when it is not one (of this version)."""
        try:
            doc = json.loads(text)
            body = doc["script_job"]
            if body["v"] != SCRIPT_JOB_VERSION:
                raise ValueError(f"version {body['v']!r}, this daemon reads {SCRIPT_JOB_VERSION}")
            env = tuple((str(k), str(v)) for k, v in body["env"])
            return cls(
                script_name=str(body["script_name"]),
                script_sha256=str(body["script_sha256"]),
                chdir=str(body["chdir"]),
                log_dir=str(body["log_dir"]),
                logs=tuple(str(p) for p in body["logs"]),
                marker=None if body["marker"] is None else str(body["marker"]),
                marker_format=str(body["marker_format"]),
                results=tuple(str(p) for p in body["results"]),
                job_name_prefix=_opt(body["job_name_prefix"]),
                sbatch_args=tuple(str(a) for a in body["sbatch_args"]),
                prefill_gpus=_opt_int(body["prefill_gpus"]),
                decode_gpus=_opt_int(body["decode_gpus"]),
                env=env,
                concurrency_env=str(body["concurrency_env"]),
                concurrency_separator=str(body["concurrency_separator"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            why = f"not a script campaign's job ({exc})"
            raise SpecError("script_job", text[:80], why) from None


def _opt(value: object) -> str | None:
    return None if value is None else str(value)


def _opt_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def is_script_job(text: str) -> bool:
    """Whether a journaled job's spec is a `ScriptJob` (else it is a run spec's TOML)."""
    return text.lstrip().startswith("{")  # JSON; a TOML document cannot start so


def _under(campaign_dir: str, path: str | None, default: str) -> str:
    if path is None:
        return default
    return posixpath.normpath(posixpath.join(campaign_dir, path))


def script_job(
    launcher: Launcher,
    point: ScriptPoint,
    *,
    script_name: str,
    script_sha256: str,
    campaign_dir: str,
    values: Values = (),
) -> ScriptJob:
    """The job of `point` (`values`: its matrix values, for errors): the launcher's paths
    under `campaign_dir` (the campaign file's absolute directory), its patterns with the
    job's variables, its sbatch options after ``--nodes``."""
    chdir = _under(campaign_dir, launcher.chdir, posixpath.normpath(campaign_dir))
    env = dict(point.env)
    return ScriptJob(
        script_name=script_name,
        script_sha256=script_sha256,
        chdir=chdir,
        log_dir=_under(campaign_dir, launcher.log_dir, chdir),
        logs=_with_env("logs", launcher.logs, env, values),
        marker=launcher.marker,
        marker_format=launcher.marker_format,
        results=_with_env("results", launcher.results, env, values),
        job_name_prefix=launcher.job_name_prefix,
        sbatch_args=(f"--nodes={point.nodes}", *launcher.sbatch_args),
        prefill_gpus=launcher.prefill_gpus,
        decode_gpus=launcher.decode_gpus,
        env=point.env,
        concurrency_env=launcher.concurrency_env,
        concurrency_separator=launcher.concurrency_separator,
    )
