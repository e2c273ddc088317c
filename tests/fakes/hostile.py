"""What a hostile job can leave in its log directory instead of plain files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from llmd_supervisor.adapters.nodes import jobfiles as jobfiles

SECRET = b"root:$6$secret-hash:19000:0:99999:7:::\n"


def plant(d: Path, secret: Path) -> dict[str, str]:
    """Every kind of non-plain file a job can leave; name -> the refusal's words."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "link").symlink_to(secret)
    os.mkfifo(d / "fifo")
    (d / "dir").mkdir()
    (d / "dirlink").symlink_to(secret.parent)
    (d / "hard").write_bytes(b"x")
    os.link(d / "hard", d / "hard2")
    (d / "big").write_bytes(b"y" * (jobfiles.SMALL_FILE_MAX + 1))
    os.mknod(d / "zero", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # like /dev/zero
    (d / "theirs").write_bytes(b"another uid's file")
    os.chown(d / "theirs", 65534, 65534)
    return {
        "link": "is a symbolic link",
        "fifo": "is a FIFO",
        "dir": "is a directory",
        "dirlink/shadow": "dirlink on its way is a symbolic link",
        "hard": "2 hard links",
        "big": "larger than 65536 bytes",
        "zero": "is a device",
        "theirs": "owned by uid 65534",
    }
