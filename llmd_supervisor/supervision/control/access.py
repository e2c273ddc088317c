"""Who may see and act on which run: the control API's access policy (DESIGN.md section 9).

The transport reports the peer's credentials (SO_PEERCRED); this module decides. A user
may see and cancel their own runs; root and members of the configured admin group may see
and cancel everyone's.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import socket

from llmd_supervisor.adapters.control.protocol import Peer

__all__ = ["may_access", "sees_all"]


def may_access(peer: Peer, owner_uid: int, admin_group: str | int | None) -> bool:
    """Whether `peer` may read or act on a run owned by `owner_uid`.

    Allowed: root, the owner, and members of `admin_group` (by gid or name): the peer's
    gid, the user's primary group, or a supplementary membership by user name. An admin
    group that does not exist admits nobody. Group lookups go through NSS and may block
    when NSS is remote (LDAP, sssd).
    """
    return peer.uid == owner_uid or sees_all(peer, admin_group)


def sees_all(peer: Peer, admin_group: str | int | None) -> bool:
    """Whether `peer` may read and act on every run: root, or a member of `admin_group`."""
    if peer.uid == 0:
        return True
    if admin_group is None:
        return False
    if isinstance(admin_group, int):
        gid = admin_group
    else:
        try:
            gid = grp.getgrnam(admin_group).gr_gid
        except KeyError:
            return False
    if peer.gid == gid:
        return True
    try:
        user = pwd.getpwuid(peer.uid)
    except KeyError:
        return False
    if user.pw_gid == gid:
        return True
    try:
        if user.pw_name in grp.getgrgid(gid).gr_mem:
            return True
    except KeyError:
        return False
    # NSS backends that do not list members in the group entry still answer this.
    return gid in os.getgrouplist(user.pw_name, user.pw_gid)


def user_name(uid: int) -> str | None:
    """The account name of `uid` (None when the system has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return None


@functools.cache
def host_name() -> str:
    """This host's name, for a mail's Message-ID and From (no DNS lookup)."""
    return socket.gethostname() or "localhost"  # core.events.outbox falls back to localhost
