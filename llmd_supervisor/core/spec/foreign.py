"""A job the daemon did not render: a user's own batch script, or a job already submitted
(pure). `submit --script` and `adopt` describe it as a `ForeignSpec`; the journal keeps it
as JSON in the run's spec column (`dump`/`load`), the archive keeps it without the
environment's values.

What the daemon watches in such a job is `Watch`: the directory its files are under, glob
patterns for its logs and results (relative to that directory; ``{job_id}`` is the Slurm
job id; wildcards ``* ? [...]`` only in the last part), its completion marker and the
marker's format: ``json`` (this project's protocol), ``int`` (InferenceX's launcher: the rc
and a newline) or ``none`` (no marker protocol: Slurm's evidence alone decides). The batch
logs are where the job's own ``--output``/``--error`` say, as ``scontrol show job`` reports
them (StdOut/StdErr).

Everything here is checked as hostile input: names, patterns, sbatch options and the
environment are bounded, and a value that cannot be honoured safely is refused with the
option that sets it and what to do instead.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Final, Literal

from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.errors import SpecError
from llmd_supervisor.node.common import MARKER_PREFIX

SCRIPT_MAX: Final = 1 << 20  # bytes of a batch script
ENV_MAX_VARS: Final = 1000
ENV_MAX_BYTES: Final = 256 * 1024
PATTERNS_MAX: Final = 32
SBATCH_ARGS_MAX: Final = 64
DEFAULT_GRACE_S: Final = 30
NAME_MAX: Final = 64  # characters of the run's name `list` shows
JOB_ID_PLACEHOLDER: Final = "{job_id}"
# A marker format given without --marker: the name our agent and `verify --log-dir` use.
DEFAULT_MARKER: Final = MARKER_PREFIX + JOB_ID_PLACEHOLDER

_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_JOB_ID = re.compile(r"[1-9][0-9]{0,11}")
ENV_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")  # a shell variable's name
# One part of a pattern: plain characters and the glob wildcards, nothing a shell or
# Slurm would expand differently.
_PART = re.compile(r"[A-Za-z0-9._+\-*?\[\]{}=,@%]{1,255}")
_WILDCARDS = frozenset("*?[")
# sbatch options the daemon sets itself, or that would defeat supervision, with the
# option that replaces each.
_SBATCH_REFUSED: Final[Mapping[str, str]] = {
    "-J": "the daemon names the job (use --job-name-prefix)",
    "--job-name": "the daemon names the job (use --job-name-prefix)",
    "--export": "use --export-env (the client's environment) or set variables in the script",
    "--export-file": "use --export-env",
    "-D": "use --chdir",
    "--chdir": "use --chdir",
    "--uid": "jobs run as the daemon's account (use the per-user service for your own)",
    "--gid": "jobs run as the daemon's account (use the per-user service for your own)",
    "--wrap": "give the script with --script",
    "--parsable": "the daemon adds it",
    "-W": "the daemon follows the job; --wait would block its submission",
    "--wait": "the daemon follows the job; --wait would block its submission",
    "--test-only": "nothing would run; use sbatch --test-only yourself",
    "-H": "a held job would never start (submit it, then `adopt` it once released)",
    "--hold": "a held job would never start (submit it, then `adopt` it once released)",
}
# Variables of the client's environment that never reach sbatch: they would change what
# the daemon's account executes or how the job is named, exported or placed. Every
# SBATCH_* is one of sbatch's input variables (SBATCH_CLUSTERS, SBATCH_TIMELIMIT,
# SBATCH_OUTPUT, ...): an option given past the checks of SBATCH-ARGS.
SBATCH_ENV_PREFIX: Final = "SBATCH_"
_ENV_DROPPED_PREFIXES: Final = ("LD_", "BASH_FUNC_", SBATCH_ENV_PREFIX, "SLURM_")
_ENV_DROPPED: Final = frozenset(
    {"BASH_ENV", "ENV", "IFS", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME"}
)


class MarkerFormat(StrEnum):
    """How the completion marker is written."""

    JSON = "json"  # {"rc", "job_id", "rank", "reason", "finished_at"} (DESIGN.md section 4)
    INT = "int"  # the rc alone and a newline (InferenceX)
    NONE = "none"  # no marker protocol: Slurm's evidence alone
    ANY = "any"  # json or int: the daemon's own rendered runs


@dataclass(frozen=True)
class Watch:
    """What the daemon watches of a foreign job, below `log_dir`."""

    log_dir: str
    logs: tuple[str, ...] = ()
    marker: str | None = None
    marker_format: MarkerFormat = MarkerFormat.NONE
    results: tuple[str, ...] = ()

    def expand(self, pattern: str, job_id: str) -> str:
        """A pattern with the job id put in, as an absolute path."""
        return f"{self.log_dir}/{pattern.replace(JOB_ID_PLACEHOLDER, job_id)}"

    def marker_path(self, job_id: str) -> str | None:
        if self.marker is None or self.marker_format is MarkerFormat.NONE:
            return None
        return self.expand(self.marker, job_id)

    def dirs(self, patterns: Sequence[str], job_id: str) -> tuple[str, ...]:
        """The directories to list for `patterns` (each once, in order)."""
        return tuple(dict.fromkeys(posixpath.dirname(self.expand(p, job_id)) for p in patterns))

    def matching(self, patterns: Sequence[str], job_id: str, directory: str, name: str) -> bool:
        """Whether `directory/name` matches one of `patterns`."""
        path = f"{directory}/{name}"
        return any(
            posixpath.dirname(full := self.expand(p, job_id)) == directory
            and fnmatchcase(path, full)
            for p in patterns
        )

    def copy_name(self, path: str) -> str:
        """A matched file's copy name: its path below the log directory."""
        return path.removeprefix(self.log_dir + "/")


@dataclass(frozen=True)
class ForeignSpec:
    """A user's batch script to submit (`kind` script) or a submitted job (`kind` adopt)."""

    kind: Literal["script", "adopt"]
    watch: Watch
    script: str = ""  # the batch script as submitted ("" for an adopted job)
    script_name: str = ""  # its file name, for messages and the archive
    chdir: str | None = None
    env: Mapping[str, str] | None = None  # --export-env: the client's environment
    sbatch_args: tuple[str, ...] = ()
    job_name_prefix: str | None = None
    job_id: str | None = None  # the adopted job
    sigterm_grace_s: int = DEFAULT_GRACE_S
    # --prefill-gpus / --decode-gpus: the roles' GPUs its per-GPU numbers are divided by
    # (None: as its result files declare, else by their total).
    prefill_gpus: int | None = None
    decode_gpus: int | None = None
    env_dropped: tuple[str, ...] = field(default=(), compare=False)  # names left out

    def job_name(self, run_id: str) -> str:
        """The run's unique Slurm job name (`P-<run id>` with a prefix)."""
        return f"{self.job_name_prefix or 'llmd'}-{run_id}"

    def sbatch_options(self, job_name: str) -> list[str]:
        """sbatch's options for the script (before the user's own)."""
        options = [f"--job-name={job_name}"]
        if self.chdir is not None:
            options.append(f"--chdir={self.chdir}")
        return [*options, *self.sbatch_args]

    def describe(self) -> str:
        if self.kind == "adopt":
            return f"adopted job {self.job_id}"
        return f"batch script {self.script_name or '(stdin)'}"

    def name(self) -> str:
        """What `list` calls the run: the script's file name (escaped: the client's text),
        or ``adopted-JOBID``."""
        if self.kind == "adopt":
            return f"adopted-{self.job_id}"
        return job_text(posixpath.basename(self.script_name), NAME_MAX)


def dump(spec: ForeignSpec, *, with_env_values: bool = True) -> str:
    """The spec as the journal keeps it (the archive's copy: `with_env_values` False)."""
    w = spec.watch
    env: object = dict(spec.env) if spec.env is not None else None
    if env is not None and not with_env_values:
        env = sorted(spec.env or {})
    body = {
        "kind": spec.kind,
        "log_dir": w.log_dir,
        "logs": list(w.logs),
        "marker": w.marker,
        "marker_format": w.marker_format.value,
        "results": list(w.results),
        "script": spec.script,
        "script_name": spec.script_name,
        "chdir": spec.chdir,
        "env": env,
        "sbatch_args": list(spec.sbatch_args),
        "job_name_prefix": spec.job_name_prefix,
        "job_id": spec.job_id,
        "sigterm_grace_s": spec.sigterm_grace_s,
        "prefill_gpus": spec.prefill_gpus,
        "decode_gpus": spec.decode_gpus,
    }
    return json.dumps({"foreign": body}, indent=1, sort_keys=True) + "\n"


def is_foreign(text: str) -> bool:
    """Whether a journaled spec is a foreign one (else it is a run spec's TOML)."""
    return text.lstrip().startswith("{")  # JSON; a TOML document cannot start so


def load(text: str) -> ForeignSpec:
    """Parse and check a foreign spec (as `dump` writes it, or as a client sends it);
    SpecError naming the option and the value."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SpecError("foreign", text[:80], f"not JSON ({exc})") from None
    if not isinstance(value, dict) or not isinstance(value.get("foreign"), dict):
        raise SpecError("foreign", text[:80], 'expected {"foreign": {...}}')
    body: dict[str, object] = value["foreign"]
    kind = body.get("kind")
    if kind not in ("script", "adopt"):
        raise SpecError("kind", kind, "use 'script' or 'adopt'")
    fmt = _choice("--marker-format", body.get("marker_format", "none"))
    marker = _opt_str("--marker", body.get("marker"))
    if marker is not None:
        check_marker(marker)
    if fmt is not MarkerFormat.NONE and marker is None:
        marker = DEFAULT_MARKER  # the name `verify --log-dir` looks for
    watch = Watch(
        log_dir=_str("--log-dir", body.get("log_dir")),
        logs=_patterns("--logs", body.get("logs", [])),
        marker=marker,
        marker_format=fmt,
        results=_patterns("--results", body.get("results", [])),
    )
    script = body.get("script", "")
    if not isinstance(script, str) or len(script.encode()) > SCRIPT_MAX:
        raise SpecError("--script", type(script).__name__, f"a text of at most {SCRIPT_MAX} bytes")
    if kind == "script" and not script.startswith("#!"):
        raise SpecError(
            "--script", script[:40], "a batch script starts with '#!' (e.g. #!/bin/bash)"
        )
    check_directives(script)
    job_id = _opt_str("job_id", body.get("job_id"))
    if kind == "adopt" and (job_id is None or not _JOB_ID.fullmatch(job_id)):
        raise SpecError("JOBID", job_id, "give the numeric Slurm job id (e.g. 4711)")
    prefix = _opt_str("--job-name-prefix", body.get("job_name_prefix"))
    if prefix is not None:
        check_job_name_prefix(prefix)
    chdir = _opt_str("--chdir", body.get("chdir"))
    if chdir is not None and (not chdir.startswith("/") or posixpath.normpath(chdir) != chdir):
        raise SpecError("--chdir", chdir, "use an absolute path in normal form")
    grace = body.get("sigterm_grace_s", DEFAULT_GRACE_S)
    if type(grace) is not int or not 0 <= grace <= 3600:
        raise SpecError("sigterm_grace_s", grace, "an integer from 0 to 3600")
    env, dropped = exported_env(body.get("env"))
    prefill_gpus, decode_gpus = check_role_gpus(body.get("prefill_gpus"), body.get("decode_gpus"))
    return ForeignSpec(
        kind=kind,
        watch=watch,
        script=script,
        script_name=_str("script_name", body.get("script_name", ""), empty=True)[:255],
        chdir=chdir,
        env=env,
        sbatch_args=check_sbatch_args(body.get("sbatch_args", [])),
        job_name_prefix=prefix,
        job_id=job_id,
        sigterm_grace_s=grace,
        prefill_gpus=prefill_gpus,
        decode_gpus=decode_gpus,
        env_dropped=dropped,
    )


GPUS_MAX: Final = 1_000_000


def check_role_gpus(prefill: object, decode: object) -> tuple[int | None, int | None]:
    """--prefill-gpus and --decode-gpus: both or neither, whole numbers (decode > 0)."""
    if prefill is None and decode is None:
        return None, None
    for option, value, low in (("--prefill-gpus", prefill, 0), ("--decode-gpus", decode, 1)):
        if type(value) is not int or not low <= value <= GPUS_MAX:
            raise SpecError(
                option,
                value,
                f"give both --prefill-gpus and --decode-gpus, whole numbers ({low} to"
                f" {GPUS_MAX}): the GPUs of each role, across all its nodes",
            )
    assert isinstance(prefill, int) and isinstance(decode, int)
    return prefill, decode


def check_marker(marker: str) -> None:
    """SpecError unless `marker` is a pattern (`check_pattern`) naming one file."""
    check_pattern("--marker", marker)
    if _WILDCARDS & set(marker):
        raise SpecError("--marker", marker, "name one file (no wildcards)")


def check_job_name_prefix(prefix: str) -> None:
    if not _PREFIX.fullmatch(prefix):
        raise SpecError("--job-name-prefix", prefix, "use 1-64 letters, digits, '.', '_' or '-'")


def check_pattern(option: str, pattern: str) -> None:
    """SpecError unless `pattern` is relative, without '.'/'..' parts, wildcards only in
    its last part, and ``{job_id}`` its only placeholder."""
    parts = pattern.split("/")
    if pattern.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise SpecError(
            option, pattern, "use a pattern relative to --log-dir without '.', '..' or '//'"
        )
    for i, part in enumerate(parts):
        if not _PART.fullmatch(part):
            raise SpecError(option, pattern, f"part {part!r} has a character not allowed")
        if i < len(parts) - 1 and _WILDCARDS & set(part):
            raise SpecError(option, pattern, "wildcards are allowed only in the last part")
        if "{" in part.replace(JOB_ID_PLACEHOLDER, "") or "}" in part.replace(
            JOB_ID_PLACEHOLDER, ""
        ):
            raise SpecError(option, pattern, "the only placeholder is {job_id}")


def check_sbatch_args(value: object) -> tuple[str, ...]:
    """The user's sbatch options, refusing those the daemon sets or that defeat it. An
    option that takes a value may have it in the next word, as sbatch allows (`-N 3`,
    `--nodes 3`): it is joined into one (`-N3`, `--nodes=3`)."""
    if not isinstance(value, list) or len(value) > SBATCH_ARGS_MAX:
        raise SpecError("SBATCH-ARGS", value, f"a list of at most {SBATCH_ARGS_MAX} options")
    words = list(value)
    args: list[str] = []
    while words:
        arg = _sbatch_word(words.pop(0))
        _check_sbatch_arg(arg)
        if _takes_separate_value(arg):
            if not words:
                raise SpecError("SBATCH-ARGS", arg, f"{arg} needs a value: {arg} VALUE")
            joined = _sbatch_word(words.pop(0), value=True)
            arg = f"{arg}={joined}" if arg.startswith("--") else arg + joined
        args.append(arg)
    return tuple(args)


def _sbatch_word(word: object, *, value: bool = False) -> str:
    if not isinstance(word, str) or "\0" in word or len(word) > 4096:
        raise SpecError("SBATCH-ARGS", word, "give each option and value as a text")
    if not value and not word.startswith("-"):
        raise SpecError("SBATCH-ARGS", word, "give options only, as --name=value or -N 2")
    return word


def _takes_separate_value(arg: str) -> bool:
    """Whether `arg` is an option written without the value it takes (`-N`, `--nodes`)."""
    if arg.startswith("--"):
        return "=" not in arg and arg not in _SBATCH_FLAGS and arg != "--"
    return len(arg) == 2 and arg not in _SHORT_FLAGS and arg not in _SBATCH_REFUSED


# What a script's own #SBATCH lines may not ask for: the daemon could not follow the job.
_DIRECTIVES_REFUSED: Final = ("-W", "--wait", "-H", "--hold", "--uid", "--gid", "--test-only")


def check_directives(script: str) -> None:
    """SpecError if the script's ``#SBATCH`` lines (those sbatch reads: before the first
    command) hold an option that would keep the daemon from following the job."""
    for line in script.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return  # sbatch stops reading directives at the first command
        if not stripped.startswith("#SBATCH"):
            continue
        for word in stripped.removeprefix("#SBATCH").split():
            if word.startswith("#"):
                break
            name = word.split("=", 1)[0]
            name = name if name.startswith("--") else name[:2]
            for refused in _DIRECTIVES_REFUSED:
                if refused == name or (len(name) > 3 and refused.startswith(name)):
                    raise SpecError(
                        "--script",
                        stripped[:120],
                        f"{refused} in a #SBATCH line: {_SBATCH_REFUSED[refused]}",
                    )


# sbatch's options that take no value (sbatch --help, Slurm 22.05 and 24.11).
_SBATCH_FLAGS: Final = frozenset(
    {"--contiguous", "--exclusive", "--ignore-pbs", "--no-kill", "--no-requeue", "--overcommit",
     "--oversubscribe", "--quiet", "--requeue", "--reboot", "--spread-job", "--use-min-nodes",
     "--verbose", "--get-user-env"}
)  # fmt: skip
_SHORT_FLAGS: Final = frozenset({"-O", "-Q", "-k", "-s", "-v", "-V", "-h", "-I"})


def _check_sbatch_arg(arg: str) -> None:
    """One sbatch option: never one the daemon sets or that defeats it, in any spelling
    sbatch takes (an unambiguous prefix of a long option; short flags in one word)."""

    def refuse(how: str) -> SpecError:
        return SpecError("SBATCH-ARGS", arg, how)

    if arg.startswith("--"):
        name = arg.split("=", 1)[0]
        for refused, why in _SBATCH_REFUSED.items():
            if refused.startswith("--") and len(name) > 2 and refused.startswith(name):
                raise refuse(f"{refused} is not allowed: {why}")
        return
    letter = arg[:2]
    if letter in _SBATCH_REFUSED:
        raise refuse(f"{letter} is not allowed: {_SBATCH_REFUSED[letter]}")
    if letter in _SHORT_FLAGS and len(arg) > 2:
        raise refuse("give each short flag in a word of its own")


def env_refused(name: str) -> bool:
    """Whether an exported environment leaves `name` out: it would change what sbatch
    executes or how it names, places or exports the job (`LD_*`, `BASH_ENV`, `SLURM_*`,
    `SBATCH_*`, ...). The one filter of `--export-env` (client and daemon) and of a
    script campaign's ``[launcher.env]`` and matrix."""
    return name in _ENV_DROPPED or name.startswith(_ENV_DROPPED_PREFIXES)


def env_bytes(env: Mapping[str, str]) -> int:
    """What `env` counts against ENV_MAX_BYTES: NAME=value and a terminator per variable."""
    return sum(len(name) + len(val.encode()) + 2 for name, val in env.items())


def exported_env(value: object) -> tuple[dict[str, str] | None, tuple[str, ...]]:
    """An environment to export as `--export-env` takes it: the variables kept, and the
    names left out (not shell names, not text, or `env_refused`); SpecError when it is
    too large."""
    if value is None:
        return None, ()
    if not isinstance(value, dict) or len(value) > ENV_MAX_VARS:
        raise SpecError("--export-env", type(value).__name__, f"at most {ENV_MAX_VARS} variables")
    env: dict[str, str] = {}
    dropped: list[str] = []
    for name, val in value.items():
        if not isinstance(val, str) or not ENV_NAME_RE.fullmatch(name) or "\0" in val:
            dropped.append(str(name)[:128])
            continue
        if env_refused(name):
            dropped.append(name)
            continue
        env[name] = val
    size = env_bytes(env)
    if size > ENV_MAX_BYTES:
        raise SpecError(
            "--export-env", f"{size} bytes", f"the environment exported is at most {ENV_MAX_BYTES}"
        )
    return env, tuple(sorted(dropped))


def _choice(option: str, value: object) -> MarkerFormat:
    if value not in ("json", "int", "none"):
        raise SpecError(option, value, "use json, int or none")
    return MarkerFormat(value)


def _str(option: str, value: object, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or "\0" in value:
        raise SpecError(option, value, "give a non-empty text")
    return value


def _opt_str(option: str, value: object) -> str | None:
    return None if value is None else _str(option, value)


def _patterns(option: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > PATTERNS_MAX:
        raise SpecError(option, value, f"a list of at most {PATTERNS_MAX} patterns")
    for p in value:
        check_pattern(option, _str(option, p))
    return tuple(value)
