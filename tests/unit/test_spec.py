"""Run spec validation: table tests, unknown keys, injection attempts."""

from __future__ import annotations

import copy
import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from llmd_supervisor.core.spec.runspec import (
    ALLOWED_SBATCH_OPTIONS,
    RESERVED_SBATCH_OPTIONS,
    ContainerKind,
    RunSpec,
    Validity,
    check_daemon_dirs,
    load_spec,
    parse_spec,
    time_limit_seconds,
)
from llmd_supervisor.core.spec.slurm_table import extra_arg
from llmd_supervisor.errors import SpecError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "llm-d"
DEMO = tomllib.loads((DEPLOY / "demo.toml").read_text())

INJECTIONS = [
    "$(rm -rf /)",
    "`rm -rf /`",
    "a;rm -rf /",
    "a\nrm -rf /",
    "a && b",
    "a|b",
    "${HOME}",
    "a b",
    "'quoted'",
    '"quoted"',
    "a%x",
    "a>b",
]


def demo(**changes: Any) -> dict[str, Any]:
    """The demo spec with dotted-path changes applied (value None deletes the key)."""
    data = copy.deepcopy(DEMO)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        table = data
        for p in parents:
            table = table.setdefault(p, {})
        if value is None:
            table.pop(last, None)
        else:
            table[last] = value
    return data


def spec_error(data: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return info.value


def test_demo_spec_parses() -> None:
    spec = load_spec((DEPLOY / "demo.toml").read_text())
    assert isinstance(spec, RunSpec)
    assert spec.topology.nodes == 4 and spec.topology.coordinator_rank == 2
    assert spec.container.kind is ContainerKind.NONE
    assert spec.benchmark.concurrencies == (1, 2, 4)
    assert math.isinf(spec.benchmark.request_rate)
    assert spec.slurm.requeue is False
    assert spec.sigterm_grace_s == 10
    assert spec.name == "demo"  # what `list` calls its runs


def test_a_spec_without_a_name_is_unnamed() -> None:
    assert parse_spec(demo(run__name=None)).name == ""


def test_example_gpu_specs_parse() -> None:
    spec = load_spec((DEPLOY / "example-vllm-pyxis.toml").read_text())
    assert spec.container.kind is ContainerKind.PYXIS
    assert spec.container.squash_file is not None
    assert spec.container.extra_args == ("--container-writable", "--container-remap-root")
    assert spec.topology.gpus_per_node == 8
    assert spec.slurm.extra_args == ("--exclusive", "--mem=0")
    docker = load_spec((DEPLOY / "example-vllm-docker.toml").read_text())
    assert docker.container.kind is ContainerKind.DOCKER
    assert "--device=/dev/infiniband" in docker.container.extra_args
    # The same processes under either container.
    assert (docker.engine, docker.sidecar, docker.router, docker.benchmark, docker.env) == (
        spec.engine,
        spec.sidecar,
        spec.router,
        spec.benchmark,
        spec.env,
    )


def test_defaults() -> None:
    data = demo(run__sigterm_grace_s=None, container=None, env=None)
    data["engine"].pop("port")
    spec = parse_spec(data)
    assert spec.sigterm_grace_s == 30
    assert spec.container.kind is ContainerKind.NONE and spec.container.python == "python3"
    assert spec.engine.port == 8000 and spec.engine.port_stride == 0
    assert dict(spec.env.common) == {}


def test_toml_syntax_error() -> None:
    with pytest.raises(SpecError) as info:
        load_spec("[run\nlog_dir = 1")
    assert info.value.field == "<toml>"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({**DEMO, "extra": {}}, "extra"),
        (demo(run__logdir="/x"), "run.logdir"),
        (demo(topology__gpus="1"), "topology.gpus"),
        (demo(slurm__qos="high"), "slurm.qos"),
        (demo(env__worker={}), "env.worker"),
    ],
)
def test_unknown_keys_are_named_with_the_allowed_ones(data: dict[str, Any], field: str) -> None:
    err = spec_error(data)
    assert err.field == field
    assert "unknown key" in err.hint and "allowed" in err.hint
    if field == "run.logdir":
        assert "log_dir" in str(err)


@pytest.mark.parametrize(
    ("changes", "field", "hint_part"),
    [
        ({"run": None}, "run", "required"),
        ({"run__log_dir": None}, "run.log_dir", "required"),
        ({"run__log_dir": "relative/dir"}, "run.log_dir", "absolute path"),
        ({"run__sigterm_grace_s": 0}, "run.sigterm_grace_s", "1 to"),
        ({"run__sigterm_grace_s": True}, "run.sigterm_grace_s", "integer"),
        ({"run__sigterm_grace_s": 400}, "run.sigterm_grace_s", "shorter than slurm.time_limit"),
        ({"run__marker_grace_s": -1}, "run.marker_grace_s", "seconds"),
        ({"run__name": "my run"}, "run.name", "letters, digits and . _ -"),
        ({"run__name": ".."}, "run.name", "first a letter or digit"),
        ({"run__name": "x" * 65}, "run.name", "1 to 64"),
        ({"run__name": 7}, "run.name", "letters"),
        ({"topology__prefill_nodes": 0}, "topology.prefill_nodes", "integer from 1"),
        ({"topology__decode_nodes": "2"}, "topology.decode_nodes", "integer"),
        ({"topology__prefill_workers": 3}, "topology.prefill_workers", "divisible"),
        ({"topology__decode_workers": 4}, "topology.decode_workers", "divisible"),
        ({"topology__gpus_per_node": -1}, "topology.gpus_per_node", "integer"),
        ({"model__served_name": None}, "model.served_name", "required"),
        ({"container__kind": "podman"}, "container.kind", "'none', 'docker', 'pyxis'"),
        ({"container__kind": "docker"}, "container.image", "needs an image"),
        ({"container__kind": "pyxis"}, "container.squash_file", "needs a squash file"),
        ({"container__image": "vllm/vllm:1"}, "container.kind", "only apply"),
        ({"engine__port": 80}, "engine.port", "1024 to 65535"),
        ({"engine__prefill_command": []}, "engine.prefill_command", "non-empty"),
        ({"engine__prefill_command": "python3 x"}, "engine.prefill_command", "list"),
        ({"engine__decode_command": ["x", 3]}, "engine.decode_command[1]", "string"),
        (
            {"engine__decode_command": ["x", "{nope}"]},
            "engine.decode_command[1]",
            "unknown placeholder",
        ),
        ({"engine__decode_command": ["x", "{port"]}, "engine.decode_command[1]", "'{{'"),
        ({"engine__decode_command": ["a\nb"]}, "engine.decode_command[0]", "control"),
        (
            {"engine__prefill_command": ["x", "{concurrency}"]},
            "engine.prefill_command[1]",
            "unknown placeholder",
        ),
        ({"engine__health_path": "health"}, "engine.health_path", "URL path"),
        ({"benchmark__concurrencies": []}, "benchmark.concurrencies", "at least one"),
        ({"benchmark__concurrencies": [1, 1]}, "benchmark.concurrencies", "duplicate"),
        ({"benchmark__concurrencies": [1, True]}, "benchmark.concurrencies[1]", "integer"),
        ({"benchmark__concurrencies": [0]}, "benchmark.concurrencies[0]", "integer"),
        ({"benchmark__request_rate": 0}, "benchmark.request_rate", "positive"),
        ({"benchmark__request_rate": "fast"}, "benchmark.request_rate", "'inf'"),
        ({"benchmark__input_len": 0}, "benchmark.input_len", "integer"),
        ({"slurm__time_limit": None}, "slurm.time_limit", "required"),
        ({"slurm__time_limit": "1h"}, "slurm.time_limit", "Slurm time"),
        ({"slurm__time_limit": "0:30"}, "slurm.time_limit", "minimum is 1 minute"),
        ({"slurm__requeue": "yes"}, "slurm.requeue", "true or false"),
        ({"slurm__extra_args": "--exclusive"}, "slurm.extra_args", "list"),
        ({"slurm__extra_args": ["-N4"]}, "slurm.extra_args[0]", "'--option'"),
        ({"slurm__extra_args": ["--exclusive", "--nodes=8"]}, "slurm.extra_args[1]", "--nodes"),
        ({"slurm__extra_args": ["--time=1"]}, "slurm.extra_args[0]", "cannot be overridden"),
        ({"slurm__extra_args": ["--part=x"]}, "slurm.extra_args[0]", "--partition"),
        ({"slurm__extra_args": ["--requeue"]}, "slurm.extra_args[0]", "cannot be overridden"),
        ({"slurm__extra_args": ["--signal=B:USR1@5"]}, "slurm.extra_args[0]", "--signal"),
        ({"slurm__extra_args": ["--export=NONE"]}, "slurm.extra_args[0]", "--export"),
        ({"slurm__extra_args": ["--job-name=x"]}, "slurm.extra_args[0]", "--job-name"),
        ({"slurm__extra_args": ["--output=/tmp/x"]}, "slurm.extra_args[0]", "--output"),
        ({"env__common": {"1BAD": "x"}}, "env.common.1BAD", "variable names"),
        ({"env__prefill": {"SLURM_PROCID": "0"}}, "env.prefill.SLURM_PROCID", "set by the agent"),
        ({"env__decode": {"X": ["a"]}}, "env.decode.X", "string"),
        ({"env__bench": {"X": "a\nb"}}, "env.bench.X", "control"),
        ({"env__bench": "X=1"}, "env.bench", "table"),
    ],
)
def test_invalid_values(changes: dict[str, Any], field: str, hint_part: str) -> None:
    err = spec_error(demo(**changes))
    assert err.field == field
    assert hint_part in err.hint
    # The message is a sentence naming the field, the value and the fix.
    assert repr(field) in str(err) and err.hint in str(err)


# Every string that lands in the batch script itself, with what makes the spec valid.
SCRIPT_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("run.log_dir", {}),
    ("model.path", {}),
    ("model.served_name", {}),
    ("container.python", {}),
    ("container.image", {"container__kind": "docker", "container__image": "x"}),
    ("container.squash_file", {"container__kind": "pyxis", "container__squash_file": "/x"}),
    ("container.mounts", {"container__kind": "pyxis", "container__squash_file": "/x"}),
    ("slurm.partition", {}),
    ("slurm.account", {}),
    ("slurm.time_limit", {}),
    ("slurm.extra_args", {}),
    ("engine.health_path", {}),
]


@pytest.mark.parametrize("payload", INJECTIONS)
@pytest.mark.parametrize(("field", "base"), SCRIPT_FIELDS)
def test_injection_into_script_fields_is_rejected(
    field: str, base: dict[str, Any], payload: str
) -> None:
    table, key = field.split(".")
    value: Any = payload
    if key == "mounts":
        value = [f"/a:{payload}"]
    elif key == "extra_args":
        value = [f"--exclusive={payload}"]
    elif key in ("log_dir", "path", "squash_file", "health_path"):
        value = "/ok/" + payload
    err = spec_error(demo(**{**base, f"{table}__{key}": value}))
    assert err.field.startswith(field)


@pytest.mark.parametrize("payload", [p for p in INJECTIONS if "\n" not in p])
def test_shell_metacharacters_in_argv_and_env_are_data(payload: str) -> None:
    # Commands and env values never meet a shell (JSON to the agent, exec of argv lists);
    # they are kept verbatim and proven inert by the render tests.
    # Braces are template syntax in commands; literal ones are doubled.
    arg = payload.replace("{", "{{").replace("}", "}}")
    spec = parse_spec(
        demo(
            engine__prefill_command=["python3", arg],
            env__prefill={"X": payload},
        )
    )
    assert spec.engine.prefill_command == ("python3", arg)
    assert spec.env.prefill["X"] == payload


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30", 1800),
        ("30:15", 1815),
        ("01:30:00", 5400),
        ("2-0", 172800),
        ("1-02:03", 93780),
        ("1-00:00:05", 86405),
    ],
)
def test_time_limit_seconds(value: str, seconds: int) -> None:
    assert time_limit_seconds(value) == seconds
    assert parse_spec(demo(slurm__time_limit=value)).slurm.time_limit_s == seconds


def test_request_rate_number_and_requeue() -> None:
    spec = parse_spec(demo(benchmark__request_rate=2.5, slurm__requeue=True))
    assert spec.benchmark.request_rate == 2.5
    assert spec.slurm.requeue is True


def test_trailing_slash_of_paths_is_dropped() -> None:
    assert parse_spec(demo(run__log_dir="/var/tmp/x/")).log_dir == "/var/tmp/x"


# --- slurm.extra_args: an allow-list of full sbatch option names ---------------------------

SBATCH_OPTIONS_FILE = Path(__file__).resolve().parents[1] / "data" / "sbatch-options-22.05.txt"

ALLOWED_ARGS = [
    "--comment=bench/run-42",
    "--constraint=h100&ib",
    "--constraint=[rack1|rack2]",
    "--contiguous",
    "--cores-per-socket=32",
    "--cpus-per-gpu=8",
    "--cpus-per-task=16",
    "--exclude=node[1-3],gpu7",
    "--exclusive",
    "--exclusive=user",
    "--exclusive=mcs",
    "--gres=gpu:8",
    "--gres=gpu:h100:8",
    "--gres-flags=enforce-binding",
    "--gres-flags=disable-binding",
    "--licenses=fluent:2",
    "--mem=0",
    "--mem=512G",
    "--mem-per-cpu=4096",
    "--mem-per-gpu=80G",
    "--mincpus=4",
    "--nodelist=node[1-4]",
    "--oversubscribe",
    "--prefer=h100",
    "--qos=high",
    "--reservation=maint,bench",
    "--sockets-per-node=2",
    "--spread-job",
    "--switches=1@10:00",
    "--threads-per-core=1",
    "--tmp=100G",
    "--wckey=bench",
]

# (arg, what the hint must say)
REFUSED_ARGS = [
    ("--export-file=/etc/shadow", "reads a file on the login node"),
    ("--export-file=3", "reads a file on the login node"),
    ("--bbf=/etc/shadow", "reads a file"),
    ("--nodefile=/etc/hosts", "reads a file"),
    ("--nodelist=/etc/hostlist", "no '/'"),
    ("--exclude=/root/hosts", "no '/'"),
    ("--uid=0", "changes the job's user"),
    ("--gid=0", "changes the job's group"),
    ("--get-user-env", "loads a login environment"),
    ("--get-user-env=10L", "loads a login environment"),
    ("--priority=4294967000", "changes the job's priority"),
    ("--nice=-10000", "changes the job's priority"),
    ("--nice", "changes the job's priority"),
    ("--reboot", "reboots"),
    ("--export=NONE", "cannot be overridden"),
    ("--export=ALL,TOKEN=x", "cannot be overridden"),
    ("--tasks-per-node=2", "alias of --ntasks-per-node"),
    ("--tasks-per=2", "abbreviates --tasks-per-node"),
    ("--ntasks-per=2", "abbreviates --ntasks-per-node"),
    ("--exp=NONE", "abbreviates --export"),
    ("--excl", "write --exclude or --exclusive"),
    ("--mem-per=4G", "write --mem-per-cpu or --mem-per-gpu"),
    ("--constr=h100", "write --constraint"),
    ("-C", "write --constraint"),
    ("-Ch100", "write --constraint=VALUE"),
    ("-C h100", "write --constraint=VALUE"),
    ("-x=node1", "write --exclude=VALUE"),
    ("-N4", "short sbatch options are not accepted"),
    ("-t60", "short sbatch options are not accepted"),
    ("--clusters=other", "not an sbatch option a run spec may set"),
    ("--container=/bundle", "not an sbatch option a run spec may set"),
    ("--propagate", "not an sbatch option a run spec may set"),
    ("--test-only", "not an sbatch option a run spec may set"),
    ("--hold", "not an sbatch option a run spec may set"),
    ("--time-min=1", "not an sbatch option a run spec may set"),
    ("--mail-user=a@example.org", "not an sbatch option a run spec may set"),
    ("--array=1-3", "cannot be overridden"),
    ("--wrap=true", "cannot be overridden"),
    ("--gpus-per-node=8", "topology.gpus_per_node"),
    ("--exclusive=everyone", "'user' or 'mcs'"),
    ("--contiguous=yes", "takes no value"),
    ("--mem", "needs a value"),
    ("--mem=lots", "a size like 64G"),
    ("--cpus-per-task=-1", "a count"),
    ("--qos=", "names:"),
    ("--constraint=a;b", "node features"),
    ("--EXCLUSIVE", "write it as '--option' or '--option=value'"),
    ("--exclusive --mem=0", "write it as"),
    ("exclusive", "write it as"),
    ("--comment=" + "x" * 300, "at most 256 characters"),
]


@pytest.mark.parametrize("arg", ALLOWED_ARGS)
def test_allowed_extra_args_pass_unchanged(arg: str) -> None:
    assert parse_spec(demo(slurm__extra_args=[arg])).slurm.extra_args == (arg,)


def test_every_allowed_option_has_an_allowed_example() -> None:
    named = {a.split("=", 1)[0].removeprefix("--") for a in ALLOWED_ARGS}
    assert named == set(ALLOWED_SBATCH_OPTIONS)


@pytest.mark.parametrize(("arg", "hint_part"), REFUSED_ARGS)
def test_refused_extra_args_name_the_value_and_the_fix(arg: str, hint_part: str) -> None:
    err = spec_error(demo(slurm__extra_args=["--exclusive", arg]))
    assert err.field == "slurm.extra_args[1]"
    assert hint_part in err.hint
    assert len(str(err)) < 1000  # the control socket's error replies are capped there


def test_refusal_lists_the_allowed_options() -> None:
    err = spec_error(demo(slurm__extra_args=["--export-file=/etc/shadow"]))
    assert "'--export-file=/etc/shadow'" in str(err)
    assert all(f"--{name}" in err.hint for name in ALLOWED_SBATCH_OPTIONS)
    assert "remove it" in err.hint and "full names" in err.hint


def test_too_many_extra_args() -> None:
    err = spec_error(demo(slurm__extra_args=["--contiguous"] * 33))
    assert err.field == "slurm.extra_args" and "at most 32" in err.hint


def _man_page_options() -> dict[str, tuple[str | None, str, str]]:
    """name -> (short, value kind, verdict) from tests/data/sbatch-options-22.05.txt."""
    out = {}
    for line in SBATCH_OPTIONS_FILE.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        synopsis, verdict = (part.strip() for part in line.rsplit("|", 1))
        m = re.match(r"(?:-([A-Za-z]), )?--([a-z][a-z0-9-]*)(\[=|=)?", synopsis)
        assert m is not None, line
        kind = {None: "none", "=": "required", "[=": "optional"}[m.group(3)]
        out[m.group(2)] = (m.group(1), kind, verdict)
    return out


def test_allowed_options_are_real_sbatch_options_with_their_short_forms() -> None:
    man = _man_page_options()
    assert len(man) == 102
    for name, option in ALLOWED_SBATCH_OPTIONS.items():
        assert name in man, name
        short, kind, verdict = man[name]
        assert (option.short, option.value, verdict) == (short, kind, "allowed"), name
    assert {n for n, (_, _, v) in man.items() if v == "allowed"} == set(ALLOWED_SBATCH_OPTIONS)
    for name in RESERVED_SBATCH_OPTIONS:
        assert name in man or name == "tasks-per-node", name


def test_every_other_man_page_option_is_refused() -> None:
    for name, (short, _, verdict) in _man_page_options().items():
        if verdict == "allowed":
            continue
        for arg in (f"--{name}", f"--{name}=1", *([f"-{short}1"] if short else [])):
            with pytest.raises(SpecError):
                extra_arg("slurm.extra_args[0]", arg)


# --- container.python and mounts -----------------------------------------------------------

PYXIS = {"container__kind": "pyxis", "container__squash_file": "/img/vllm.sqsh"}


@pytest.mark.parametrize(
    "python", ["python3", "python3.11", "pypy3", "/usr/bin/python3", "/opt/conda/bin/python"]
)
def test_container_python_allowed(python: str) -> None:
    assert parse_spec(demo(container__python=python)).container.python == python


@pytest.mark.parametrize(
    "python",
    [
        "-c",
        "--help",
        "-Wd",
        "-",
        "--container-image=/x",
        "bin/python3",
        "./python3",
        "/usr/../bin/python3",
        "/usr/./bin/python3",
        "/",
        "",
        "python 3",
        "python3;id",
        3,
        "a" * 65,
    ],
)
def test_container_python_refused(python: object) -> None:
    err = spec_error(demo(container__python=python))
    assert err.field == "container.python" and "never starting with '-'" in err.hint


@pytest.mark.parametrize(
    "mount",
    [
        "/data:/data",
        "/lustre/cache/hf:/root/.cache/huggingface",
        "/scratch/x:/x:ro",
        "/scratch/x:/x:rw",
        "/var/tmp/models:/models:ro",
        "/run-data:/r",
        "/var/runner:/r",
    ],
)
def test_mount_allowed(mount: str) -> None:
    assert parse_spec(demo(**PYXIS, container__mounts=[mount])).container.mounts == (mount,)


@pytest.mark.parametrize(
    ("mount", "hint_part"),
    [
        ("/:/host", "'/' cannot be mounted"),
        ("/:/host:ro", "'/' cannot be mounted"),
        ("/var/run/docker.sock:/var/run/docker.sock", "overlaps /var/run/docker.sock"),
        ("/run/docker.sock:/d.sock", "overlaps /run/docker.sock"),
        ("/run:/run", "overlaps /run/docker.sock"),
        ("/var/run:/r", "overlaps /var/run/docker.sock"),
        ("/var:/v:ro", "overlaps /var/run/docker.sock"),
        ("/run/munge:/run/munge", "overlaps /run/munge"),
        ("/var/run/munge/munge.socket.2:/m", "overlaps /var/run/munge"),
        ("/etc/munge:/e:ro", "overlaps /etc/munge"),
        ("/etc:/e:ro", "overlaps /etc/munge"),
        ("/data/../var/run/docker.sock:/d", "no '.' or '..' parts"),
        ("/data/./x:/x", "no '.' or '..' parts"),
        ("/a:/b:rx", "'SRC:DST:ro'"),
        ("relative:/x", "'SRC:DST:ro'"),
        ("/a", "'SRC:DST:ro'"),
        ("/a:/b:ro:x", "'SRC:DST:ro'"),
        ("/a b:/b", "'SRC:DST:ro'"),
    ],
)
def test_mount_refused(mount: str, hint_part: str) -> None:
    err = spec_error(demo(**PYXIS, container__mounts=["/ok:/ok", mount]))
    assert err.field == "container.mounts[1]" and hint_part in err.hint


@pytest.mark.parametrize(
    ("field", "key"), [("run.log_dir", "run__log_dir"), ("model.path", "model__path")]
)
@pytest.mark.parametrize("path", ["/", "/run", "/var/run/munge"])
def test_implicitly_mounted_dirs_are_checked_in_containers(field: str, key: str, path: str) -> None:
    err = spec_error(demo(**PYXIS, **{key: path}))
    assert err.field == field and "mounted into the container" in err.hint
    if key == "model__path":  # without a container the model path is only a string
        assert parse_spec(demo(**{key: path})).model.path == path


@pytest.mark.parametrize("path", ["/var/tmp/../x", "/var/tmp/./x", "/.."])
def test_paths_with_dot_parts_are_refused(path: str) -> None:
    assert "no '.' or '..' parts" in spec_error(demo(run__log_dir=path)).hint


DAEMON_DIRS = ("/var/lib/llmd-supervisor", "/srv/archive/", "/run/llmd-supervisor")


@pytest.mark.parametrize(
    ("changes", "field", "hit"),
    [
        (
            {"run__log_dir": "/var/lib/llmd-supervisor/runs"},
            "run.log_dir",
            "/var/lib/llmd-supervisor",
        ),
        ({"run__log_dir": "/srv/archive"}, "run.log_dir", "/srv/archive"),
        (
            {**PYXIS, "container__mounts": ["/var/lib:/x"]},
            "container.mounts[0]",
            "/var/lib/llmd-supervisor",
        ),
        (
            {**PYXIS, "container__mounts": ["/ok:/ok", "/srv/archive/r1:/a:ro"]},
            "container.mounts[1]",
            "/srv/archive",
        ),
        ({**PYXIS, "model__path": "/srv"}, "model.path", "/srv/archive"),
    ],
)
def test_check_daemon_dirs_refuses(changes: dict[str, Any], field: str, hit: str) -> None:
    spec = parse_spec(demo(**changes))
    with pytest.raises(SpecError) as info:
        check_daemon_dirs(spec, DAEMON_DIRS)
    assert info.value.field == field and f"supervisor's directory {hit}" in info.value.hint


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"run__log_dir": "/var/lib/llmd-supervisor-runs"},
        {**PYXIS, "container__mounts": ["/var/lib/other:/o", "/srv/data:/d"]},
        {"model__path": "/srv"},  # no container: the model path is not mounted
    ],
)
def test_check_daemon_dirs_allows(changes: dict[str, Any]) -> None:
    check_daemon_dirs(parse_spec(demo(**changes)), DAEMON_DIRS)


# --- TOML text that tomllib cannot take --------------------------------------------------------

DEMO_TEXT = (DEPLOY / "demo.toml").read_text()


@pytest.mark.parametrize(
    ("text", "field", "hint_part"),
    [
        ("x = " + "[" * 100_000 + "]" * 100_000, "<toml>", "nested more than 16 deep"),
        ("x = " + "{a=" * 40 + "1" + "}" * 40, "<toml>", "nested more than 16 deep"),
        ("x = [" * 20 + "]" * 20, "<toml>", "nested more than 16 deep"),
        ("a." * 20_000 + "b = 1", "<toml>", "more than 16 parts"),
        ("[" + "t." * 30 + "u]", "<toml>", "more than 16 parts"),
        ("x = " + "9" * 5000, "<toml>", "4300 digits"),
        ("x = -" + "9" * 5000, "<toml>", "4300 digits"),
        ("x = 0x" + "f" * 5000, "x", "fit in 64 bits"),
        ("x = [1, 0o" + "7" * 100 + "]", "x[1]", "fit in 64 bits"),
        (DEMO_TEXT.replace("prefill_nodes = 2", "prefill_nodes = 99999999999999999999"),
         "topology.prefill_nodes", "fit in 64 bits"),
        (DEMO_TEXT.replace('time_limit = "00:05:00"', 'time_limit = "' + "9" * 5000 + '"'),
         "slurm.time_limit", "Slurm time"),
        ('x = "\ud800"', "<toml>", "lone surrogate"),
        ("x = 1\n" + "#" * (256 * 1024), "<toml>", "at most 262144 characters"),
        ("x = [1,,2]", "<toml>", "not valid TOML"),
        ("x = \x00", "<toml>", "not valid TOML"),
    ],
)  # fmt: skip
def test_toml_failures_are_spec_errors(text: str, field: str, hint_part: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(text)
    assert info.value.field == field and hint_part in info.value.hint
    assert len(str(info.value)) < 1000


def test_a_toml_syntax_error_names_the_line_not_the_files_text() -> None:
    with pytest.raises(SpecError) as info:
        load_spec('[run]\nname = "secret-ish"\nlog_dir = /x\n')
    assert "line 3" in str(info.value) and "secret-ish" not in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        'x = "' + "a." * 40 + '"',  # dots and brackets inside strings are data
        "x = '" + "[" * 40 + "'",
        'x = """\n' + "{[" * 40 + '\n"""',
        "x = '''" + "a." * 40 + "''''",
        'x = "\\"' + "[" * 40 + '"',  # an escaped quote does not end a basic string
        "x = 1 # " + "[." * 40,  # a comment
        "x = [" + ", ".join(["1.5"] * 100) + "]",  # many floats, one dot each
    ],
)
def test_scan_skips_strings_and_comments(text: str) -> None:
    # The text gets past the scan to the spec's own validation (unknown key x).
    assert spec_error_text(text).field == "x"


def test_scan_follows_a_literal_string_ending_in_a_backslash() -> None:
    # 'a\' is a complete literal string: the brackets after it are structure.
    with pytest.raises(SpecError) as info:
        load_spec("x = ['a\\'" + ", [" * 20 + "]" * 21)
    assert "nested more than 16 deep" in info.value.hint


def spec_error_text(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_spec(text)
    return info.value


# --- benchmark.result_format and [benchmark.validity] -----------------------------------


def test_benchmark_result_defaults() -> None:
    spec = parse_spec(demo())
    assert spec.benchmark.result_format == "vllm"
    assert spec.benchmark.validity == Validity(0.95, 1, None)
    assert spec.benchmark.num_prompts(4) == 4 * DEMO["benchmark"]["prompts_multiplier"]
    assert spec.benchmark.expected_prompts() == {1: 4, 2: 8, 4: 16}


def test_benchmark_result_settings() -> None:
    spec = parse_spec(
        demo(
            benchmark__result_format="inferencex",
            benchmark__validity={
                "min_completed_fraction": 1,
                "min_output_tokens": 0,
                "max_failed": 3,
            },
        )
    )
    assert spec.benchmark.result_format == "inferencex"
    assert spec.benchmark.validity == Validity(1.0, 0, 3)
    assert isinstance(spec.benchmark.validity.min_completed_fraction, float)
    spec = parse_spec(demo(benchmark__validity={"min_completed_fraction": 0.5}))
    assert spec.benchmark.validity == Validity(0.5, 1, None)


def test_benchmark_validity_from_toml() -> None:
    text = (DEPLOY / "demo.toml").read_text()
    assert "\n[benchmark.validity]\nmin_completed_fraction = 0.95\n" in text
    text = text.replace(
        "min_completed_fraction = 0.95", "min_completed_fraction = 0.9\nmax_failed = 2"
    )
    assert load_spec(text).benchmark.validity == Validity(0.9, 1, 2)


@pytest.mark.parametrize(
    ("changes", "field", "hint_part"),
    [
        ({"benchmark__result_format": "sglang"}, "benchmark.result_format", "'inferencex'"),
        ({"benchmark__result_format": 1}, "benchmark.result_format", "'vllm'"),
        ({"benchmark__validity": 0.9}, "benchmark.validity", "table"),
        (
            {"benchmark__validity": {"min_completed": 0.9}},
            "benchmark.validity.min_completed",
            "unknown key",
        ),
        (
            {"benchmark__validity": {"min_completed_fraction": 0}},
            "benchmark.validity.min_completed_fraction",
            "greater than 0",
        ),
        (
            {"benchmark__validity": {"min_completed_fraction": 1.5}},
            "benchmark.validity.min_completed_fraction",
            "at most 1",
        ),
        (
            {"benchmark__validity": {"min_completed_fraction": "95%"}},
            "benchmark.validity.min_completed_fraction",
            "fraction",
        ),
        (
            {"benchmark__validity": {"min_completed_fraction": math.nan}},
            "benchmark.validity.min_completed_fraction",
            "fraction",
        ),
        (
            {"benchmark__validity": {"min_completed_fraction": True}},
            "benchmark.validity.min_completed_fraction",
            "fraction",
        ),
        (
            {"benchmark__validity": {"min_output_tokens": -1}},
            "benchmark.validity.min_output_tokens",
            ">= 0",
        ),
        (
            {"benchmark__validity": {"min_output_tokens": 1.5}},
            "benchmark.validity.min_output_tokens",
            "integer",
        ),
        (
            {"benchmark__validity": {"max_failed": -1}},
            "benchmark.validity.max_failed",
            ">= 0",
        ),
        (
            {"benchmark__validity": {"max_failed": "none"}},
            "benchmark.validity.max_failed",
            "leave it out",
        ),
    ],
)
def test_benchmark_result_errors(changes: dict[str, Any], field: str, hint_part: str) -> None:
    err = spec_error(demo(**changes))
    assert err.field == field
    assert hint_part in err.hint, err.hint


# Every string field of the spec, given text built to make a backtracking regex explode
# (a long run of allowed characters, then one that is not). A pattern with nested
# quantifiers takes hours on these, and `re` cannot be interrupted, so the check runs in a
# child process with a limit no linear pattern comes near.
_ADVERSARIAL = ["/" + "a" * 5000 + " ", "/" + "a/" * 2500 + " ", "a" * 5000 + "!", "-" * 5000]
_HANG_CHECK = """
import copy, sys, tomllib
from llmd_supervisor.core.spec.runspec import parse_spec
from llmd_supervisor.errors import SpecError
demo = tomllib.loads(open(sys.argv[1]).read())
def strings(t, path=()):
    for k, v in t.items():
        if isinstance(v, dict):
            yield from strings(v, (*path, k))
        elif isinstance(v, str):
            yield (*path, k)
        elif isinstance(v, list) and v and isinstance(v[0], str):
            yield (*path, k, 0)
tried = 0
for where in strings(demo):
    for bad in %r:
        data = copy.deepcopy(demo)
        t = data
        for k in where[:-1]:
            t = t[k]
        t[where[-1]] = bad
        try:
            parse_spec(data)
        except SpecError:
            pass
        tried += 1
print(tried)
"""


@pytest.mark.parametrize("example", ["demo.toml", "example-vllm-pyxis.toml"])
def test_no_field_pattern_backtracks_on_adversarial_text(example: str) -> None:
    code = _HANG_CHECK % (_ADVERSARIAL,)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(DEPLOY / example)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 60  # every string field, each way


# --- [standins] ---------------------------------------------------------------------------

EXAMPLE = tomllib.loads((DEPLOY / "example-vllm-pyxis.toml").read_text())


def test_the_demo_opts_into_the_stand_ins_and_the_examples_do_not() -> None:
    assert load_spec((DEPLOY / "demo.toml").read_text()).standins is True
    for path in DEPLOY.glob("example-vllm-*.toml"):
        assert load_spec(path.read_text()).standins is False, path.name


def test_a_command_that_runs_a_stand_in_needs_the_table() -> None:
    err = spec_error(demo(standins=None))
    assert err.field == "engine.prefill_command" and err.value == "{node_dir}/engine.py"
    assert "[standins] enabled = true" in str(err) and "add that table" in str(err)
    err = spec_error(demo(standins__enabled=False))
    assert err.field == "engine.prefill_command"


def test_a_fault_knob_needs_the_table() -> None:
    data = copy.deepcopy(EXAMPLE)
    data.setdefault("env", {}).setdefault("bench", {})["LLMD_FAKE_BENCH_HANG"] = "1"
    err = spec_error(data)
    assert err.field == "env.bench.LLMD_FAKE_BENCH_HANG"
    assert "[standins] enabled = true" in str(err) and "remove the knob" in str(err)
    data["standins"] = {"enabled": True}  # a knob alone is a use (the agent's fault hooks)
    assert parse_spec(data).standins is True


def test_the_table_with_nothing_to_carry_is_refused() -> None:
    data = copy.deepcopy(EXAMPLE)
    data["standins"] = {"enabled": True}
    err = spec_error(data)
    assert err.field == "standins.enabled" and err.value is True
    assert "no command runs a stand-in" in str(err) and "remove the [standins] table" in str(err)


@pytest.mark.parametrize("value", ["yes", 1, 0, [True]])
def test_standins_enabled_is_a_boolean(value: object) -> None:
    err = spec_error(demo(standins__enabled=value))
    assert err.field == "standins.enabled" and "true or false" in str(err)


def test_standins_has_one_key() -> None:
    err = spec_error(demo(standins__engine="real"))
    assert "standins" in err.field
