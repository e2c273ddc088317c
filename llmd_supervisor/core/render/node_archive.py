"""The node files as one deterministic archive, for the batch script to carry (pure).

A gzip'd ustar tar: entries sorted by path, each directory before its files, mtime 0,
uid and gid 0 without user or group names, mode 0644 for files (the agent and the
stand-ins run as ``python3 FILE``, none needs 0755) and 0755 for directories; the gzip
header has mtime 0 and no file name. The same files give the same bytes (for one Python
and zlib), so the same spec renders byte-identically.

gzip rather than xz or bzip2: tar and gzip are Essential in Debian, so every node's root
file system has them (the dev cluster's minimal Debian 13 one too); xz-utils and bzip2
are only "standard" there.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import posixpath
import re
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["EmbeddedFile", "NodeArchive", "pack"]

# The node directory's paths are ours: letters, digits, ``_``, ``.`` and ``/``.
_PATH = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./]*")


@dataclass(frozen=True)
class EmbeddedFile:
    """One file of the archive, as the script's table of contents shows it."""

    path: str  # in the node directory
    size: int  # bytes
    sha256: str  # hex


@dataclass(frozen=True)
class NodeArchive:
    """The node files' ``.tar.gz`` and what it holds."""

    data: bytes
    files: tuple[EmbeddedFile, ...]  # sorted by path

    @property
    def sha256(self) -> str:
        """The archive's own sha256 (hex), which the batch shell checks before unpacking."""
        return hashlib.sha256(self.data).hexdigest()


def check_path(path: str) -> str:
    """`path` if it is a plain relative path of ours; raises ``ValueError`` otherwise."""
    if not _PATH.fullmatch(path) or ".." in path or "//" in path or path.endswith("/"):
        raise ValueError(f"unexpected node file path {path!r}")
    return path


def pack(files: Mapping[str, str]) -> NodeArchive:
    """The archive of `files` (path in the node directory -> text, written as UTF-8)."""
    blobs = {check_path(p): text.encode("utf-8") for p, text in files.items()}
    dirs = {d for p in blobs for d in _parents(p)}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in sorted(dirs | set(blobs)):  # "a" sorts before "a/b"
            info = tarfile.TarInfo(path)  # mtime 0, uid/gid 0, no uname/gname
            if path in dirs:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.mode, info.size = 0o644, len(blobs[path])
                tar.addfile(info, io.BytesIO(blobs[path]))
    data = gzip.compress(raw.getvalue(), compresslevel=9, mtime=0)
    table = tuple(
        EmbeddedFile(p, len(b), hashlib.sha256(b).hexdigest()) for p, b in sorted(blobs.items())
    )
    return NodeArchive(data, table)


def _parents(path: str) -> list[str]:
    parents = []
    while (path := posixpath.dirname(path)) != "":
        parents.append(path)
    return parents
