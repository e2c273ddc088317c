"""The ``[container]`` part of the run spec, and which host paths a job may not mount.

``container.python`` is an interpreter name (``python3``) or an absolute path: never
something starting with ``-``, which would become an option of srun or docker. A mount's
source may not be ``/``, nor be, contain or lie inside a path that hands out control of
the host or of Slurm (:data:`FORBIDDEN_MOUNT_SOURCES`: the docker socket, munge's socket
and key directories), nor any directory of the daemon (checked where the daemon knows
its directories: :func:`llmd_supervisor.core.spec.runspec.check_daemon_dirs`). Paths are
compared as written, after refusing ``.`` and ``..`` parts; a symbolic link on a shared
file system is not resolved here (no I/O). Pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from llmd_supervisor.core.spec.container_args import container_extra_args, container_user
from llmd_supervisor.core.spec.fields import (
    PATH_RE,
    list_field,
    path_field,
    pattern_field,
    plain_path,
    shown,
)
from llmd_supervisor.errors import SpecError

__all__ = [
    "FORBIDDEN_MOUNT_SOURCES",
    "IMAGE_RE",
    "PYTHON_NAME_RE",
    "Container",
    "ContainerKind",
    "mount",
    "overlapping",
    "parse_container",
    "python_field",
]

IMAGE_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,255}")
PYTHON_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
# Host paths no container may see (nor any directory holding them, nor anything inside).
FORBIDDEN_MOUNT_SOURCES: Final = (
    "/var/run/docker.sock",
    "/run/docker.sock",
    "/run/munge",
    "/var/run/munge",
    "/etc/munge",
)


class ContainerKind(StrEnum):
    """How the node agent and engines are started on each node."""

    NONE = "none"  # bare processes with the node's python3 (dev cluster)
    DOCKER = "docker"  # `docker run --network=host` per task
    PYXIS = "pyxis"  # srun --container-image=<squash file> (enroot/pyxis)


@dataclass(frozen=True)
class Container:
    kind: ContainerKind = ContainerKind.NONE
    image: str | None = None
    squash_file: str | None = None
    mounts: tuple[str, ...] = ()
    python: str = "python3"
    extra_args: tuple[str, ...] = ()  # checked by spec_container_args
    user: str | None = None  # docker --user UID[:GID]


def overlapping(path: str, dirs: Iterable[str]) -> str | None:
    """The first of `dirs` that `path` equals, lies inside or contains (None: none)."""
    p = path.rstrip("/") or "/"
    for d in dirs:
        d = d.rstrip("/") or "/"
        if p == d or p == "/" or d == "/" or d.startswith(p + "/") or p.startswith(d + "/"):
            return d
    return None


def mount_source_error(path: str) -> str | None:
    """Why `path` may not be mounted into a container (None: it may)."""
    if path.rstrip("/") == "":
        return "the root directory '/' cannot be mounted; mount the directories the job needs"
    hit = overlapping(path, FORBIDDEN_MOUNT_SOURCES)
    if hit is not None:
        return (
            f"it overlaps {hit}, which gives control of the host or of Slurm"
            "; mount a directory that neither holds nor lies inside it"
        )
    return None


def mount(fld: str, value: object) -> str:
    """Validate one ``container.mounts`` entry ('SRC:DST' or 'SRC:DST:ro|rw')."""
    if not isinstance(value, str):
        raise SpecError(fld, shown(value), "a mount is a string 'SRC:DST' or 'SRC:DST:ro'")
    parts = value.split(":")
    ok = len(parts) in (2, 3) and all(PATH_RE.fullmatch(p) and plain_path(p) for p in parts[:2])
    if not ok or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise SpecError(
            fld,
            shown(value),
            "use 'SRC:DST' or 'SRC:DST:ro' with absolute, plain paths (no '.' or '..' parts)",
        )
    why = mount_source_error(parts[0])
    if why is not None:
        raise SpecError(fld, value, why)
    return value


def python_field(t: Mapping[str, object]) -> str:
    """``container.python``: a command name or an absolute plain path (default python3)."""
    value = t.get("python")
    if value is None:
        return "python3"
    hint = (
        "name an interpreter like 'python3' or '/usr/bin/python3'"
        " (a name of letters, digits and . _ + -, or an absolute path; never starting with '-')"
    )
    if not isinstance(value, str):
        raise SpecError("container.python", shown(value), hint)
    if PYTHON_NAME_RE.fullmatch(value) or (
        len(value) <= 200 and PATH_RE.fullmatch(value) and plain_path(value) and value != "/"
    ):
        return value
    raise SpecError("container.python", shown(value), hint)


def parse_container(t: Mapping[str, object]) -> Container:
    raw_kind = t.get("kind", "none")
    try:
        kind = ContainerKind(raw_kind if isinstance(raw_kind, str) else "")
    except ValueError:
        raise SpecError(
            "container.kind", raw_kind, "use one of 'none', 'docker', 'pyxis'"
        ) from None
    image = pattern_field(
        t, "container.image", IMAGE_RE, "use a registry reference like 'vllm/vllm-openai:v0.9'"
    )
    squash = path_field(t, "container.squash_file")
    mounts = tuple(
        mount(f"container.mounts[{i}]", m) for i, m in enumerate(list_field(t, "container.mounts"))
    )
    python = python_field(t)
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
    extra = container_extra_args(t, kind.value)
    user = container_user(t, kind.value)
    return Container(kind, image, squash, mounts, python, extra, user)
