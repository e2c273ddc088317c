"""container.extra_args and container.user: the allow-list, its refusals, and where they render."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import pytest

from llmd_supervisor.core.render.script import render_sbatch
from llmd_supervisor.core.spec.container_args import DOCKER_OPTIONS, PYXIS_OPTIONS
from llmd_supervisor.core.spec.runspec import parse_spec
from llmd_supervisor.errors import SpecError

DEMO = tomllib.loads((Path(__file__).parents[2] / "deploy/llm-d/demo.toml").read_text())
DOCKER = {"kind": "docker", "image": "vllm/vllm-openai:v0.11.0"}
PYXIS = {"kind": "pyxis", "squash_file": "/img/vllm.sqsh"}


def spec_data(container: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(DEMO)
    data["container"] = container
    return data


def refusal(container: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(spec_data(container))
    return info.value


def srun_line(container: dict[str, Any]) -> str:
    script = render_sbatch(parse_spec(spec_data(container)), job_name="j")
    return next(ln for ln in script.splitlines() if ln.startswith("srun "))


# InferenceX's llm-d launcher (benchmarks/multi_node/llm-d/job.slurm) passes these.
INFERENCEX_DOCKER = [
    "--privileged",
    "--device=/dev/infiniband",
    "--cap-add=IPC_LOCK",
    "--ulimit=memlock=-1",
    "--shm-size=32G",
]
INFERENCEX_PYXIS = ["--container-writable", "--container-remap-root", "--container-env=HF_TOKEN"]

DOCKER_OK = [
    *INFERENCEX_DOCKER,
    "--device=/dev/infiniband/uverbs0:/dev/infiniband/uverbs0:rwm",
    "--ulimit=nofile=65536:65536",
    "--ulimit=stack=-1:-1",
    "--security-opt=seccomp=unconfined",
    "--security-opt=no-new-privileges",
    "--group-add=video",
]
PYXIS_OK = [
    *INFERENCEX_PYXIS,
    "--container-readonly",
    "--no-container-remap-root",
    "--container-mount-home",
    "--no-container-mount-home",
    "--no-container-entrypoint",
    "--container-env=NCCL_DEBUG,UCX_TLS",
]


def test_inferencex_options_pass_and_render_before_the_image() -> None:
    line = srun_line({**DOCKER, "extra_args": INFERENCEX_DOCKER, "user": "1000:1000"})
    head, image_and_agent = line.split(" vllm/vllm-openai:v0.11.0 ", 1)
    assert head.endswith(" --user=1000:1000 " + " ".join(INFERENCEX_DOCKER))
    assert image_and_agent.startswith('python3 "$NODE_DIR/agent.py"')
    line = srun_line({**PYXIS, "extra_args": INFERENCEX_PYXIS})
    assert " --container-workdir=/var/tmp/llmd-runs/demo " + " ".join(INFERENCEX_PYXIS) in line
    assert line.index("--container-writable") < line.index(' python3 "$NODE_DIR/agent.py"')


@pytest.mark.parametrize("arg", DOCKER_OK)
def test_docker_options_allowed(arg: str) -> None:
    assert parse_spec(spec_data({**DOCKER, "extra_args": [arg]})).container.extra_args == (arg,)


@pytest.mark.parametrize("arg", PYXIS_OK)
def test_pyxis_options_allowed(arg: str) -> None:
    assert parse_spec(spec_data({**PYXIS, "extra_args": [arg]})).container.extra_args == (arg,)


def test_every_allowed_option_has_an_allowed_example() -> None:
    named = {a[2:].split("=", 1)[0] for a in DOCKER_OK}
    assert named == set(DOCKER_OPTIONS)
    assert {a[2:].split("=", 1)[0] for a in PYXIS_OK} == set(PYXIS_OPTIONS)


@pytest.mark.parametrize(
    ("arg", "hint_part"),
    [
        ("--entrypoint=/bin/sh", "replaces what the container runs"),
        ("--user=0", "set container.user"),
        ("-u", "set container.user"),
        ("--volume=/:/host", "use container.mounts"),
        ("-v", "use container.mounts"),
        ("--mount=type=bind,src=/,dst=/h", "use container.mounts"),
        ("--env-file=/etc/shadow", "[env] tables"),
        ("-e", "[env] tables"),
        ("--network=bridge", "--network=host"),
        ("--ipc=private", "--ipc=host"),
        ("--detach", "foreground"),
        ("--pid=host", "PID namespace"),
        ("--name=x", "collide"),
        ("--gpus=0", "topology.gpus_per_node"),
        ("--cidfile=/tmp/x", "writes a file"),
        ("--device=/etc/shadow", "a host device like /dev/infiniband"),
        ("--device=/dev/../etc/shadow", "a host device like /dev/infiniband"),
        ("--device", "needs a value"),
        ("--privileged=false", "takes no value"),
        ("--cap-add=ipc_lock", "a capability"),
        ("--security-opt=seccomp=/etc/profile.json", "seccomp=unconfined"),
        ("--shm-size=32 G", "a size like 32G"),
        ("--privi", "not an option a spec may pass"),
        ("--cpus=4", "not an option a spec may pass"),
        ("-P", "short options are not accepted"),
        ("privileged", "'--option'"),
        ("--ulimit=memlock=-1;id", "a limit like"),
    ],
)
def test_docker_options_refused(arg: str, hint_part: str) -> None:
    err = refusal({**DOCKER, "extra_args": ["--privileged", arg]})
    assert err.field == "container.extra_args[1]" and hint_part in err.hint, err.hint


@pytest.mark.parametrize(
    ("arg", "hint_part"),
    [
        ("--container-image=docker://ubuntu", "set container.squash_file"),
        ("--container-mounts=/:/host", "use container.mounts"),
        ("--container-workdir=/", "run.log_dir"),
        ("--container-name=keep", "outlive the job"),
        ("--container-save=/tmp/x.sqsh", "writes a squash file"),
        ("--container-entrypoint", "image's entrypoint"),
        ("--container-unshare=net", "host's network"),
        ("--container-env=A;B", "variable names"),
        ("--container-env", "needs a value"),
        ("--container-writable=yes", "takes no value"),
        ("--container-w", "not an option a spec may pass"),
        ("--privileged", "allowed for pyxis (srun): --container-writable"),
    ],
)
def test_pyxis_options_refused(arg: str, hint_part: str) -> None:
    err = refusal({**PYXIS, "extra_args": [arg]})
    assert err.field == "container.extra_args[0]" and hint_part in err.hint, err.hint


def test_extra_args_need_a_container_and_are_bounded() -> None:
    err = refusal({"kind": "none", "extra_args": ["--privileged"]})
    assert err.field == "container.extra_args" and "'docker' or 'pyxis'" in err.hint
    err = refusal({**DOCKER, "extra_args": ["--privileged"] * 33})
    assert "at most 32" in err.hint
    err = refusal({**DOCKER, "extra_args": [7]})
    assert err.field == "container.extra_args[0]" and "string" in err.hint
    err = refusal({**DOCKER, "extra_args": ["--group-add=" + "a" * 300]})
    assert "at most 256 characters" in err.hint


@pytest.mark.parametrize(
    ("container", "hint_part"),
    [
        ({**DOCKER, "user": "root"}, "numeric 'UID' or 'UID:GID'"),
        ({**DOCKER, "user": "0:0;id"}, "numeric 'UID' or 'UID:GID'"),
        ({**DOCKER, "user": 1000}, "numeric 'UID' or 'UID:GID'"),
        ({**PYXIS, "user": "1000"}, "--container-remap-root"),
        ({"kind": "none", "user": "1000"}, "only docker containers take a user"),
    ],
)
def test_container_user_refused(container: dict[str, Any], hint_part: str) -> None:
    err = refusal(container)
    assert err.field == "container.user" and hint_part in err.hint, err.hint
