"""``container.extra_args`` and ``container.user``: what a spec may add to ``docker run``
or to srun's pyxis options, as an **allow-list**.

Each entry is one string, ``--name`` or ``--name=value`` with the option's full name
(docker's and pyxis's short forms and srun's unambiguous prefixes are refused: what is
checked is exactly what the tool sees). Allowed are the options a GPU benchmark needs
(InferenceX's llm-d launcher uses ``--privileged --device /dev/infiniband --cap-add
IPC_LOCK --ulimit memlock=-1 --shm-size 32G`` with docker and ``--container-writable
--container-remap-root --container-env`` with pyxis). Refused are the options that take
over the job: a different entrypoint (the container runs the node agent), a different
user (``container.user`` sets docker's ``--user`` on purpose), extra mounts or
environment that bypass ``container.mounts`` and ``[env]``, a network or IPC namespace
other than the host's (NIXL and the router need the node's own address), detaching, and
saving or naming containers on the node.

Checked against docker/cli ``cli/command/container/opts.go`` (v29.7.2-16-g28f756087e)
and NVIDIA/pyxis ``args.c`` (0.24.0, 10751994). Pure, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from llmd_supervisor.core.spec.fields import list_field, plain_path, shown
from llmd_supervisor.core.spec.slurm_table import (
    EXTRA_ARG_RE,
    MAX_EXTRA_ARG_CHARS,
    MAX_EXTRA_ARGS,
    SHORT_ARG_RE,
)
from llmd_supervisor.errors import SpecError

__all__ = [
    "DOCKER_OPTIONS",
    "PYXIS_OPTIONS",
    "ContainerOption",
    "container_extra_args",
    "container_user",
]


@dataclass(frozen=True)
class ContainerOption:
    """One option a spec may pass; ``pattern`` None: it takes no value."""

    pattern: re.Pattern[str] | None = None
    hint: str = ""


_DEVICE: Final = re.compile(
    r"/dev/[A-Za-z0-9._+/-]{1,200}(?::/dev/[A-Za-z0-9._+/-]{1,200})?(?::[rwm]{1,3})?"
)
_CAP: Final = re.compile(r"[A-Z][A-Z_]{1,31}")
_ULIMIT: Final = re.compile(r"[a-z]{1,16}=-?[0-9]{1,19}(?::-?[0-9]{1,19})?")
_SIZE: Final = re.compile(r"[0-9]{1,12}[bkmgBKMG]?")
_SECURITY: Final = re.compile(
    r"seccomp=unconfined|apparmor=unconfined|label=disable|no-new-privileges(?:=true|=false)?"
)
_GROUP: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,31}")
_ENV_NAMES: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}(?:,[A-Za-z_][A-Za-z0-9_]{0,63}){0,63}")
USER_RE: Final = re.compile(r"[0-9]{1,10}(?::[0-9]{1,10})?")

DOCKER_OPTIONS: Final[dict[str, ContainerOption]] = {
    "privileged": ContainerOption(),
    "device": ContainerOption(
        _DEVICE, "a host device like /dev/infiniband[:/dev/infiniband[:rwm]]"
    ),
    "cap-add": ContainerOption(_CAP, "a capability like IPC_LOCK"),
    "ulimit": ContainerOption(_ULIMIT, "a limit like memlock=-1 or nofile=65536:65536"),
    "shm-size": ContainerOption(_SIZE, "a size like 32G"),
    "security-opt": ContainerOption(
        _SECURITY, "seccomp=unconfined, apparmor=unconfined, label=disable or no-new-privileges"
    ),
    "group-add": ContainerOption(_GROUP, "a group name or id like video"),
}
PYXIS_OPTIONS: Final[dict[str, ContainerOption]] = {
    "container-writable": ContainerOption(),
    "container-readonly": ContainerOption(),
    "container-remap-root": ContainerOption(),
    "no-container-remap-root": ContainerOption(),
    "container-mount-home": ContainerOption(),
    "no-container-mount-home": ContainerOption(),
    "no-container-entrypoint": ContainerOption(),
    "container-env": ContainerOption(_ENV_NAMES, "variable names like NCCL_DEBUG,UCX_TLS"),
}

_MOUNTS: Final = "use container.mounts (checked against host paths that give control of it)"
_ENV: Final = "put the job's variables in the spec's [env] tables"
_REFUSED_DOCKER: Final[dict[str, str]] = {
    "entrypoint": "it replaces what the container runs, which is the node agent",
    "user": "set container.user to run the container as another UID[:GID]",
    "u": "set container.user to run the container as another UID[:GID]",
    "volume": _MOUNTS,
    "v": _MOUNTS,
    "mount": _MOUNTS,
    "volumes-from": _MOUNTS,
    "env": _ENV,
    "e": _ENV,
    "env-file": _ENV,
    "network": "the supervisor runs every container with --network=host"
    " (NIXL and the router need the node's own address)",
    "net": "the supervisor runs every container with --network=host",
    "ipc": "the supervisor runs every container with --ipc=host",
    "gpus": "set topology.gpus_per_node (the supervisor then passes --gpus=all)",
    "detach": "the node agent must run in the foreground of its Slurm task",
    "d": "the node agent must run in the foreground of its Slurm task",
    "rm": "the supervisor already passes --rm",
    "init": "the supervisor already passes --init",
    "name": "container names would collide between runs on a node",
    "workdir": "the node agent chooses its working directory",
    "w": "the node agent chooses its working directory",
    "pid": "it shares or changes the PID namespace the agent's signals rely on",
    "userns": "it changes the container's user namespace",
    "cgroupns": "it changes the container's cgroup namespace",
    "restart": "Slurm and the supervisor decide what is restarted",
    "cidfile": "it writes a file on the node",
}
_REFUSED_PYXIS: Final[dict[str, str]] = {
    "container-image": "set container.squash_file",
    "container-mounts": _MOUNTS,
    "container-workdir": "the supervisor sets the working directory to run.log_dir",
    "container-name": "named containers outlive the job on the node and collide between runs",
    "container-save": "it writes a squash file on the node",
    "container-entrypoint": "it runs the image's entrypoint before the node agent",
    "container-entrypoint-log": "it only matters with the image's entrypoint, which is not run",
    "container-unshare": "the node agent needs the host's network and IPC namespaces",
}


def container_extra_args(t: Mapping[str, object], kind: str) -> tuple[str, ...]:
    """``container.extra_args`` for a container of `kind` ('docker', 'pyxis' or 'none')."""
    items = list_field(t, "container.extra_args")
    if items and kind == "none":
        raise SpecError(
            "container.extra_args",
            shown(items),
            "extra container options only apply to kind 'docker' or 'pyxis'; remove them",
        )
    if len(items) > MAX_EXTRA_ARGS:
        raise SpecError(
            "container.extra_args", len(items), f"give at most {MAX_EXTRA_ARGS} extra options"
        )
    return tuple(_one(f"container.extra_args[{i}]", a, kind) for i, a in enumerate(items))


def _one(fld: str, arg: object, kind: str) -> str:
    tool = "docker run" if kind == "docker" else "pyxis (srun)"
    options, refused = (
        (DOCKER_OPTIONS, _REFUSED_DOCKER) if kind == "docker" else (PYXIS_OPTIONS, _REFUSED_PYXIS)
    )
    allowed = ", ".join(f"--{n}" for n in options)
    fix = f"allowed for {tool}: {allowed} (full names, as '--option' or '--option=value')"
    if not isinstance(arg, str):
        raise SpecError(fld, shown(arg), f"each extra option is a string; {fix}")
    if len(arg) > MAX_EXTRA_ARG_CHARS:
        raise SpecError(
            fld, shown(arg), f"an extra option is at most {MAX_EXTRA_ARG_CHARS} characters"
        )
    short = SHORT_ARG_RE.fullmatch(arg)
    m = EXTRA_ARG_RE.fullmatch(arg)
    name = short.group(1) if short else m.group(1) if m else None
    if name is None:
        raise SpecError(fld, shown(arg), f"write it as '--option' or '--option=value'; {fix}")
    value = None if short or m is None else m.group(2)
    option = None if short else options.get(name)
    if option is None:
        why = refused.get(name)
        if why is not None:
            raise SpecError(fld, arg, f"{tool} option {arg.split('=', 1)[0]} is refused: {why}")
        kind_of = "short options are not accepted" if short else "not an option a spec may pass"
        raise SpecError(fld, shown(arg), f"{kind_of}; {fix}")
    if option.pattern is None:
        if value is not None:
            raise SpecError(fld, arg, f"--{name} takes no value; write just --{name}")
        return arg
    if value is None:
        raise SpecError(fld, arg, f"--{name} needs a value: --{name}=VALUE ({option.hint})")
    if not option.pattern.fullmatch(value) or not plain_path(value):
        raise SpecError(fld, shown(arg), f"--{name} takes {option.hint}")
    return arg


def container_user(t: Mapping[str, object], kind: str) -> str | None:
    """``container.user``: docker's ``--user``, a numeric ``UID`` or ``UID:GID``."""
    value = t.get("user")
    if value is None:
        return None
    if kind != "docker":
        hint = (
            "pyxis runs as the job's user (see --container-remap-root)"
            if kind == "pyxis"
            else "only docker containers take a user"
        )
        raise SpecError("container.user", shown(value), f"{hint}; remove container.user")
    if not isinstance(value, str) or not USER_RE.fullmatch(value):
        raise SpecError(
            "container.user", shown(value), "use a numeric 'UID' or 'UID:GID', e.g. '1000:1000'"
        )
    return value
