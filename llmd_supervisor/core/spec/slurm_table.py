"""The ``[slurm]`` part of the run spec: time limits and the sbatch options a spec may add.

``slurm.extra_args`` is an **allow-list**: only the sbatch options in
:data:`ALLOWED_SBATCH_OPTIONS` pass, written ``--name`` or ``--name=value`` with the full
option name. sbatch itself accepts unambiguous prefixes (``--tasks-per`` is
``--tasks-per-node``, an alias of the reserved ``--ntasks-per-node``) and short forms
(``-C``), so both are refused here: what is checked is exactly what sbatch sees.

Chosen from sbatch(1) of Slurm 22.05 (``tests/data/sbatch-options-22.05.txt``): options that
only ask for resources, placement or accounting labels. Left out on purpose: options
that read files on the login node (``--export-file``, ``--bbf``, ``--nodefile``, and a
``--nodelist``/``--exclude`` value containing ``/``, which sbatch reads as a file name),
change the job's identity, environment or priority (``--uid``, ``--gid``,
``--get-user-env``, ``--export``, ``--priority``, ``--nice``), act on nodes
(``--reboot``), change where or how the job runs in ways the supervisor relies on
(``--clusters``, ``--array``, ``--no-kill``, ``--time-min``, task layout options) and
everything the renderer sets itself (:data:`RESERVED_SBATCH_OPTIONS`). Pure, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from llmd_supervisor.core.spec.fields import shown
from llmd_supervisor.errors import SpecError

__all__ = [
    "ALLOWED_SBATCH_OPTIONS",
    "EXTRA_ARG_RE",
    "MAX_EXTRA_ARGS",
    "RESERVED_SBATCH_OPTIONS",
    "TIME_RE",
    "SbatchOption",
    "extra_arg",
    "time_limit_seconds",
]

# Slurm --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
# (At most 7 digits a part: Python refuses to convert integers of more than 4300 digits.)
TIME_RE: Final = re.compile(
    r"(?:(\d{1,7})-(\d{1,7})(?::(\d{1,7})(?::(\d{1,7}))?)?"
    r"|(\d{1,7})(?::(\d{1,7})(?::(\d{1,7}))?)?)"
)
# The shape of one extra arg; the value's own pattern is the option's.
EXTRA_ARG_RE: Final = re.compile(r"--([a-z][a-z0-9-]*)(?:=(.*))?", re.DOTALL)
SHORT_ARG_RE: Final = re.compile(r"-([A-Za-z])(.*)", re.DOTALL)
MAX_EXTRA_ARGS: Final = 32
MAX_EXTRA_ARG_CHARS: Final = 256

_NAMES: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:,@+-]{0,254}")
_FEATURES: Final = re.compile(r"[A-Za-z0-9\[(][A-Za-z0-9._:,@+&|*\[\]()-]{0,254}")
_HOSTS: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._,\[\]-]{0,254}")
_COMMENT: Final = re.compile(r"[A-Za-z0-9._:,/@+=-]{1,255}")
_COUNT: Final = re.compile(r"[0-9]{1,6}")
_SIZE: Final = re.compile(r"[0-9]{1,12}[KMGTkmgt]?")
_SWITCHES: Final = re.compile(r"[0-9]{1,6}(?:@[0-9:-]{1,16})?")

_NAMES_HINT: Final = "names: letters, digits and . _ : , @ + -"
_COUNT_HINT: Final = "a count like 8"
_SIZE_HINT: Final = "a size like 64G or 0 (units K, M, G, T)"
_NO_FILE: Final = "(no '/': sbatch reads a value with '/' as a file)"


@dataclass(frozen=True)
class SbatchOption:
    """One sbatch option a spec may set: its value is ``none``, ``required`` or ``optional``."""

    name: str
    short: str | None
    value: str
    pattern: re.Pattern[str] | None = None
    hint: str = ""


def _opt(
    name: str, short: str | None = None, pattern: re.Pattern[str] | None = None, hint: str = ""
) -> SbatchOption:
    return SbatchOption(name, short, "required" if pattern else "none", pattern, hint)


ALLOWED_SBATCH_OPTIONS: Final[dict[str, SbatchOption]] = {
    o.name: o
    for o in (
        _opt("comment", None, _COMMENT, "letters, digits and . _ : , / @ + = -"),
        _opt("constraint", "C", _FEATURES, "node features like 'h100&ib' or '[rack1|rack2]'"),
        _opt("contiguous"),
        _opt("cores-per-socket", None, _COUNT, _COUNT_HINT),
        _opt("cpus-per-gpu", None, _COUNT, _COUNT_HINT),
        _opt("cpus-per-task", "c", _COUNT, _COUNT_HINT),
        _opt("exclude", "x", _HOSTS, f"node names like 'node[1-3],gpu7' {_NO_FILE}"),
        SbatchOption("exclusive", None, "optional", re.compile(r"user|mcs"), "'user' or 'mcs'"),
        _opt("gres", None, _NAMES, "generic resources like 'gpu:8' or 'gpu:h100:8'"),
        _opt(
            "gres-flags",
            None,
            re.compile(r"disable-binding|enforce-binding"),
            "'disable-binding' or 'enforce-binding'",
        ),
        _opt("licenses", "L", _NAMES, "licenses like 'fluent:2'"),
        _opt("mem", None, _SIZE, _SIZE_HINT),
        _opt("mem-per-cpu", None, _SIZE, _SIZE_HINT),
        _opt("mem-per-gpu", None, _SIZE, _SIZE_HINT),
        _opt("mincpus", None, _COUNT, _COUNT_HINT),
        _opt("nodelist", "w", _HOSTS, f"node names like 'node[1-4]' {_NO_FILE}"),
        _opt("oversubscribe", "s"),
        _opt("prefer", None, _FEATURES, "node features like 'h100'"),
        _opt("qos", "q", _NAMES, _NAMES_HINT),
        _opt("reservation", None, _NAMES, _NAMES_HINT),
        _opt("sockets-per-node", None, _COUNT, _COUNT_HINT),
        _opt("spread-job"),
        _opt("switches", None, _SWITCHES, "a count, optionally @max-time, like '1@10:00'"),
        _opt("threads-per-core", None, _COUNT, _COUNT_HINT),
        _opt("tmp", None, _SIZE, _SIZE_HINT),
        _opt("wckey", None, _NAMES, _NAMES_HINT),
    )
}

# Options the renderer sets from the spec (or that would change how it is submitted):
# option -> what to use instead.
RESERVED_SBATCH_OPTIONS: Final[dict[str, str]] = {
    "job-name": "the supervisor names every job itself",
    "nodes": "set topology.prefill_nodes and topology.decode_nodes",
    "ntasks": "the supervisor runs one task per node",
    "ntasks-per-node": "the supervisor runs one task per node",
    "tasks-per-node": "an alias of --ntasks-per-node; the supervisor runs one task per node",
    "output": "set run.log_dir",
    "error": "set run.log_dir",
    "signal": "set run.sigterm_grace_s",
    "requeue": "set slurm.requeue",
    "no-requeue": "set slurm.requeue",
    "time": "set slurm.time_limit",
    "partition": "set slurm.partition",
    "account": "set slurm.account",
    "gpus-per-node": "set topology.gpus_per_node",
    "export": "put the job's variables in the spec's [env] tables",
    "chdir": "the job runs in its log directory's node files",
    "wait": "use `llmd-supervisor submit --wait`",
    "parsable": "the supervisor reads sbatch's output itself",
    "array": "one run is one job",
    "wrap": "the batch script is the supervisor's",
    "input": "the batch script's stdin is the supervisor's",
    "open-mode": "the supervisor owns the batch log files",
}

# Why some well-known options are refused (the rest: not on the list).
_REFUSED_BECAUSE: Final[dict[str, str]] = {
    "export-file": "it reads a file on the login node into the job's environment",
    "bbf": "it reads a file on the login node",
    "nodefile": "it reads a file on the login node",
    "uid": "it changes the job's user",
    "gid": "it changes the job's group",
    "get-user-env": "it loads a login environment into the job",
    "priority": "it changes the job's priority",
    "nice": "it changes the job's priority",
    "reboot": "it reboots the allocated nodes",
}


def allowed_list() -> str:
    return ", ".join(f"--{name}" for name in ALLOWED_SBATCH_OPTIONS)


def extra_arg(fld: str, arg: object) -> str:
    """Validate one ``slurm.extra_args`` entry; return it unchanged."""
    if not isinstance(arg, str):
        raise SpecError(fld, arg, "each extra sbatch arg is a string like '--exclusive'")
    if len(arg) > MAX_EXTRA_ARG_CHARS:
        raise SpecError(
            fld, shown(arg), f"an extra sbatch arg is at most {MAX_EXTRA_ARG_CHARS} characters"
        )
    fix = f"allowed: {allowed_list()} (full names, as '--option' or '--option=value')"
    short = SHORT_ARG_RE.fullmatch(arg)
    if short is not None:
        longs = [o.name for o in ALLOWED_SBATCH_OPTIONS.values() if o.short == short.group(1)]
        instead = f"write --{longs[0]}{'=VALUE' if short.group(2) else ''}" if longs else fix
        raise SpecError(fld, arg, f"short sbatch options are not accepted; {instead}")
    m = EXTRA_ARG_RE.fullmatch(arg)
    if m is None:
        raise SpecError(fld, arg, f"write it as '--option' or '--option=value'; {fix}")
    name, value = m.group(1), m.group(2)
    option = ALLOWED_SBATCH_OPTIONS.get(name)
    if option is None:
        raise SpecError(fld, arg, _refusal(name, fix))
    if value is None:
        if option.value == "required":
            raise SpecError(fld, arg, f"--{name} needs a value: --{name}=VALUE ({option.hint})")
        return arg
    if option.value == "none":
        raise SpecError(fld, arg, f"--{name} takes no value; write just --{name}")
    assert option.pattern is not None
    if not option.pattern.fullmatch(value):
        raise SpecError(fld, arg, f"--{name} takes {option.hint}")
    return arg


def _refusal(name: str, fix: str) -> str:
    if name in RESERVED_SBATCH_OPTIONS:
        return (
            f"--{name} is set by the supervisor from the spec and cannot be overridden"
            f" ({RESERVED_SBATCH_OPTIONS[name]})"
        )
    reserved = [o for o in RESERVED_SBATCH_OPTIONS if o.startswith(name)]
    if reserved:
        return (
            f"--{name} abbreviates --{reserved[0]}, which the supervisor sets from the spec"
            f" and cannot be overridden ({RESERVED_SBATCH_OPTIONS[reserved[0]]})"
        )
    fulls = [o for o in ALLOWED_SBATCH_OPTIONS if o.startswith(name)]
    if fulls:
        return (
            f"--{name} is an abbreviation, and only full option names are accepted;"
            f" write {' or '.join('--' + o for o in fulls)}"
        )
    why = _REFUSED_BECAUSE.get(name)
    because = f" ({why})" if why else ""
    return f"--{name} is not an sbatch option a run spec may set{because}; remove it; {fix}"


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
