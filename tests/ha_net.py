"""Two "login nodes" on this machine, for the fault tests of two daemons (issue 3.7).

Each login node is a network namespace (``llmd-login1``, ``llmd-login2``) with a persistent
UTS namespace of its own (hostname ``login1``, ``login2``) and a veth to a bridge in the
namespace that created it (``llmdha0``, 10.78.0.1/24; logins at 10.78.0.11 and .12). From
inside a login:

- the dev cluster's Slurm commands work: slurmctld and slurmdbd listen on 10.77.0.1, an
  address of this (the creating) namespace, reached through the route below; munge is a
  Unix socket, the file system is shared;
- the nodes' sshd (10.77.0.1x:22) is reachable: the login routes 10.77.0.0/24 via
  10.78.0.1, this namespace forwards between ``llmdha0`` and the dev cluster's bridge
  ``llmdbr0`` (IPv4 forwarding switched on for those two interfaces only, not
  machine-wide), and each node namespace gets a route back, 10.78.0.0/24 via 10.77.0.1
  (a node has only its on-link /24 route otherwise);
- a PostgreSQL server listening on 10.78.0.1 is reachable (tests/postgres.py
  `start_server(listen=("127.0.0.1", HA_BRIDGE_ADDR), hba=(HA_SUBNET,))`).

A login has no default route on purpose: with forwarding on and no firewall, a default
route would let stray traffic of a test leave the machine through this namespace's uplink.
It reaches 10.78.0.0/24 (on-link) and 10.77.0.0/24 (via 10.78.0.1), nothing else.

`cut(login)` cuts the login's link to the database only: an nftables table of the
``netdev`` family *inside the login's namespace* drops, at its ``eth0``'s egress, TCP to
10.78.0.1:<db port> and, at its ingress, TCP from that address and port. Packets vanish as
on a broken wire (a connect times out, an established connection stalls; no RST, no
ICMP, no EPERM to the sender, which an ``output``-hook drop would give), while the login
still reaches Slurm and the nodes: the case where a daemon that lost the database could
still act on the cluster. Everything of a cut lives in the login's namespace, so it goes
with it. `cut(login, whole_link=True)` instead sets the root-side veth down: the login
loses everything (Slurm and SSH too), as `devcluster node NODE cut` does to a node.
`is_cut(login)` checks a cut by a TCP connect to the database that must time out (and by
one to slurmctld that must succeed, for a database-only cut).

Teardown (`HaNet.close`, also at the end of the `ha_network` context) undoes everything in
reverse: the node routes, the forwarding switches (back to their previous values), each
veth (before its namespace: a veth freed with the namespace lingers 1-2 s), the
namespaces, the UTS files, the bridge; `leftovers()` lists whatever of it still exists
(empty after a clean teardown). Processes started in a login with `popen_in` are the
caller's to stop, by PID; `close` refuses to delete a namespace a process still runs in
(it SIGKILLs those by PID, from ``ip netns pids``, and says so).

Needs root, ``ip`` (iproute2), ``nsenter``/``unshare`` (util-linux) and ``nft``
(nftables; deploy/install-dev.sh installs it). Stdlib only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

__all__ = [
    "DEV_BRIDGE",
    "DEV_GATEWAY",
    "DEV_SUBNET",
    "HA_BRIDGE",
    "HA_BRIDGE_ADDR",
    "HA_SUBNET",
    "HaNet",
    "HaNetError",
    "Login",
    "connect_time",
    "cut",
    "ha_network",
    "is_cut",
    "leftovers",
    "popen_in",
    "restore",
    "run_in",
]

HA_BRIDGE = "llmdha0"
HA_PREFIX = "10.78.0"
HA_BRIDGE_ADDR = f"{HA_PREFIX}.1"
HA_SUBNET = f"{HA_PREFIX}.0/24"
# The dev cluster's network (deploy/devcluster/devcluster: BRIDGE, SUBNET).
DEV_BRIDGE = "llmdbr0"
DEV_GATEWAY = "10.77.0.1"
DEV_SUBNET = "10.77.0.0/24"
SLURMCTLD_PORT = 16817  # deploy/devcluster/devcluster: CTLD_PORT
LOGINS = ("login1", "login2")
# Persistent UTS namespace files of the logins (as the dev cluster's /run/llmd-devcluster).
NSRUN = Path(os.environ.get("LLMD_HA_NSRUN", "/run/llmd-ha"))
CUT_TABLE = "llmd_ha_cut"
_TOOLS = ("ip", "nsenter", "unshare", "nft")


class HaNetError(Exception):
    pass


@dataclass(frozen=True)
class Login:
    """One login node: its namespace, address, root-side veth and hostname."""

    name: str  # "login1": also its hostname
    index: int  # 1, 2, ...

    @property
    def netns(self) -> str:
        return f"llmd-{self.name}"

    @property
    def addr(self) -> str:
        return f"{HA_PREFIX}.{10 + self.index}"

    @property
    def host_veth(self) -> str:
        """The veth end in the creating namespace (a port of the bridge)."""
        return f"llmdha{self.index}v"

    @property
    def uts(self) -> Path:
        return NSRUN / f"uts-{self.name}"

    def enter(self) -> list[str]:
        """The prefix that runs a command in this login (network and hostname)."""
        # Not `ip netns exec`: it remounts /sys (the SLURM-FACTS note on slurmd).
        return ["nsenter", f"--net=/run/netns/{self.netns}", f"--uts={self.uts}"]


def _run(
    argv: Sequence[str], *, check: bool = True, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise HaNetError(
            f"`{' '.join(argv)}` exited {proc.returncode}: "
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def _link_exists(name: str, netns: str | None = None) -> bool:
    argv = ["ip", *(["-n", netns] if netns else []), "link", "show", name]
    return _run(argv, check=False).returncode == 0


def _netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def _sysctl_path(iface: str) -> Path:
    return Path(f"/proc/sys/net/ipv4/conf/{iface}/forwarding")


def _node_netns(node: str) -> str:
    return f"llmd-{node}"  # deploy/devcluster/devcluster: netns()


def _has_route(netns: str, prefix: str, via: str) -> bool:
    out = _run(["ip", "-n", netns, "route", "show", prefix], check=False).stdout
    return f"via {via}" in out


def missing_tools() -> list[str]:
    """The commands the harness needs that are not installed."""
    import shutil

    return [t for t in _TOOLS if shutil.which(t) is None]


@dataclass
class HaNet:
    """The logins, and what the harness changed (to undo it)."""

    logins: dict[str, Login]
    db_port: int | None = None  # the PostgreSQL port `cut` drops
    nodes: list[str] = field(default_factory=list)  # dev cluster nodes given a route back
    _saved_forwarding: dict[str, str] = field(default_factory=dict)
    _routed_nodes: list[str] = field(default_factory=list)

    def login(self, name: str) -> Login:
        return self.logins[name]

    def __iter__(self) -> Iterator[Login]:
        return iter(self.logins.values())

    # ------------------------------------------------------------ setup

    def _create(self) -> None:
        missing = missing_tools()
        if missing:
            raise HaNetError(f"missing {', '.join(missing)}: deploy/install-dev.sh installs them")
        if os.geteuid() != 0:
            raise HaNetError("the two-login network needs root (network namespaces)")
        _teardown(list(self.logins.values()), nodes=[], saved={})  # a crashed run's leftovers
        Path("/run/netns").mkdir(parents=True, exist_ok=True)
        NSRUN.mkdir(parents=True, exist_ok=True)
        _run(["ip", "link", "add", HA_BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{HA_BRIDGE_ADDR}/24", "dev", HA_BRIDGE])
        _run(["ip", "link", "set", HA_BRIDGE, "up"])
        for login in self.logins.values():
            ns, veth = login.netns, login.host_veth
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"])
            _run(["ip", "link", "set", f"{veth}p", "netns", ns])
            _run(["ip", "-n", ns, "link", "set", f"{veth}p", "name", "eth0"])
            _run(["ip", "-n", ns, "addr", "add", f"{login.addr}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "set", veth, "master", HA_BRIDGE])
            _run(["ip", "link", "set", veth, "up"])
            _run(["ip", "-n", ns, "route", "add", DEV_SUBNET, "via", HA_BRIDGE_ADDR])
            login.uts.touch()
            _run(["unshare", f"--uts={login.uts}", "hostname", login.name])
        self.route_nodes(self.nodes)

    def route_nodes(self, nodes: Sequence[str]) -> None:
        """Forwarding between the two bridges and a route back from each dev cluster node.
        Again after the dev cluster was brought down and up (its bridge and namespaces are
        new then); a no-op for what is in place already."""
        for iface in (HA_BRIDGE, DEV_BRIDGE):
            path = _sysctl_path(iface)
            if not path.exists():
                raise HaNetError(f"no interface {iface}: is the dev cluster up?")
            now = path.read_text().strip()
            # The first value seen is the one to restore (the dev cluster's bridge may be
            # new since then: it then starts from its default again, which close() keeps).
            self._saved_forwarding.setdefault(iface, now)
            if now != "1":
                path.write_text("1\n")
        for node in nodes:
            ns = _node_netns(node)
            if not _netns_exists(ns):
                raise HaNetError(f"no namespace {ns}: is the dev cluster up?")
            if not _has_route(ns, HA_SUBNET, DEV_GATEWAY):
                _run(["ip", "-n", ns, "route", "add", HA_SUBNET, "via", DEV_GATEWAY])
            if node not in self._routed_nodes:
                self._routed_nodes.append(node)

    # ------------------------------------------------------------ teardown

    def close(self) -> list[str]:
        """Undo everything; return what had to be forced (processes killed in a login)."""
        forced = _teardown(
            list(self.logins.values()), nodes=self._routed_nodes, saved=self._saved_forwarding
        )
        self._routed_nodes.clear()
        self._saved_forwarding.clear()
        return forced


def _teardown(logins: list[Login], *, nodes: list[str], saved: Mapping[str, str]) -> list[str]:
    forced: list[str] = []
    for node in nodes:
        ns = _node_netns(node)
        if _netns_exists(ns) and _has_route(ns, HA_SUBNET, DEV_GATEWAY):
            _run(["ip", "-n", ns, "route", "del", HA_SUBNET, "via", DEV_GATEWAY], check=False)
    for iface, value in saved.items():
        path = _sysctl_path(iface)
        if path.exists() and iface != HA_BRIDGE:
            path.write_text(f"{value}\n")
    for login in logins:
        if _netns_exists(login.netns):
            pids = _netns_pids(login.netns)
            if pids:
                forced.append(f"{login.netns}: SIGKILLed {pids}")
                _kill_all(login.netns)
        if _link_exists(login.host_veth):
            _run(["ip", "link", "del", login.host_veth], check=False)
        if _netns_exists(login.netns):
            _run(["ip", "netns", "del", login.netns], check=False)
        if login.uts.exists():
            _run(["umount", str(login.uts)], check=False)
            login.uts.unlink(missing_ok=True)
    if _link_exists(HA_BRIDGE):
        _run(["ip", "link", "del", HA_BRIDGE], check=False)
    if NSRUN.exists() and not any(NSRUN.iterdir()):
        NSRUN.rmdir()
    return forced


def _netns_pids(netns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", netns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_all(netns: str) -> None:
    for _ in range(50):
        pids = _netns_pids(netns)
        if not pids:
            return
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    raise HaNetError(f"processes {_netns_pids(netns)} in {netns} survived SIGKILL")


def leftovers(nodes: Sequence[str] = ()) -> list[str]:
    """What of the harness still exists: namespaces, links, UTS files, node routes, the
    forwarding switch of its bridge, nftables tables. Empty after a clean teardown."""
    left: list[str] = []
    for i, name in enumerate(LOGINS, start=1):
        login = Login(name, i)
        if _netns_exists(login.netns):
            left.append(f"namespace {login.netns}")
        if _link_exists(login.host_veth):
            left.append(f"link {login.host_veth}")
        if login.uts.exists():
            left.append(f"UTS file {login.uts}")
    if _link_exists(HA_BRIDGE):
        left.append(f"bridge {HA_BRIDGE}")
    for node in nodes:
        ns = _node_netns(node)
        if (
            _netns_exists(ns)
            and _run(["ip", "-n", ns, "route", "show", HA_SUBNET], check=False).stdout.strip()
        ):
            left.append(f"route to {HA_SUBNET} in {ns}")
    routes = _run(["ip", "route", "show", HA_SUBNET], check=False).stdout.strip()
    if routes:
        left.append(f"route {routes!r}")
    tables = _run(["nft", "list", "tables"], check=False).stdout
    if CUT_TABLE in tables:
        left.append(f"nftables table {CUT_TABLE} in this namespace")
    return left


@contextmanager
def ha_network(
    *, nodes: Sequence[str] = (), db_port: int | None = None, logins: Sequence[str] = LOGINS
) -> Iterator[HaNet]:
    """Create the logins (and the routes to the dev cluster's `nodes`), yield, tear down."""
    net = HaNet(
        logins={name: Login(name, i) for i, name in enumerate(logins, start=1)},
        db_port=db_port,
        nodes=list(nodes),
    )
    try:
        net._create()
        yield net
    finally:
        forced = net.close()
        if forced:
            raise HaNetError(f"processes were still running in the logins: {'; '.join(forced)}")


# ---------------------------------------------------------------- running in a login


def run_in(
    login: Login,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    timeout: float = 60,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run a command in the login (its network namespace and hostname) and wait for it."""
    proc = subprocess.run(
        [*login.enter(), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=dict(env) if env is not None else None,
    )
    if check and proc.returncode != 0:
        raise HaNetError(
            f"in {login.name}: `{' '.join(argv)}` exited {proc.returncode}: {proc.stderr.strip()}"
        )
    return proc


@overload
def popen_in(
    login: Login,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    text: Literal[False] = False,
    **kwargs: Any,
) -> subprocess.Popen[bytes]: ...


@overload
def popen_in(
    login: Login,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    text: Literal[True],
    **kwargs: Any,
) -> subprocess.Popen[str]: ...


def popen_in(
    login: Login,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    text: bool = False,
    **kwargs: Any,
) -> subprocess.Popen[bytes] | subprocess.Popen[str]:
    """Start a command in the login (Popen's keywords pass through; `text` as Popen's);
    the caller stops it, by its PID. `nsenter` execs the command, so the Popen's PID is the
    command's own (signals reach it directly)."""
    proc: subprocess.Popen[bytes] | subprocess.Popen[str] = subprocess.Popen(
        [*login.enter(), *argv], env=dict(env) if env is not None else None, text=text, **kwargs
    )
    return proc


# ---------------------------------------------------------------- faults


def _cut_rules(port: int) -> str:
    return f"""table netdev {CUT_TABLE} {{
  chain egress {{
    type filter hook egress device "eth0" priority 0; policy accept;
    ip daddr {HA_BRIDGE_ADDR} tcp dport {port} drop
  }}
  chain ingress {{
    type filter hook ingress device "eth0" priority 0; policy accept;
    ip saddr {HA_BRIDGE_ADDR} tcp sport {port} drop
  }}
}}
"""


def cut(
    login: Login, port: int | None = None, *, net: HaNet | None = None, whole_link: bool = False
) -> None:
    """Cut the login's link to the database (`port` on 10.78.0.1; else `net.db_port`), or
    with `whole_link` its whole link (the root-side veth down)."""
    if whole_link:
        _run(["ip", "link", "set", login.host_veth, "down"])
        return
    port = port if port is not None else (net.db_port if net is not None else None)
    if port is None:
        raise HaNetError("cut: which database port? (pass port, or a HaNet with db_port)")
    proc = subprocess.run(
        [*login.enter(), "nft", "-f", "-"],
        input=_cut_rules(port),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if proc.returncode != 0:
        raise HaNetError(f"nft in {login.name} exited {proc.returncode}: {proc.stderr.strip()}")


def restore(login: Login) -> None:
    """Undo `cut` (either kind); a no-op when the login is not cut."""
    _run(["ip", "link", "set", login.host_veth, "up"])
    tables = run_in(login, ["nft", "list", "tables"], check=True).stdout
    if CUT_TABLE in tables:
        run_in(login, ["nft", "delete", "table", "netdev", CUT_TABLE], check=True)


def connect_time(login: Login, host: str, port: int, *, timeout: float = 3.0) -> float | None:
    """Seconds a TCP connect from the login to host:port took, or None if it failed (timed
    out, refused, unreachable) within `timeout`."""
    code = (
        "import socket, sys, time\n"
        "t = time.monotonic()\n"
        "try:\n"
        f"    socket.create_connection(({host!r}, {port}), {timeout}).close()\n"
        "except OSError as e:\n"
        "    print('fail', type(e).__name__); sys.exit(1)\n"
        "print(time.monotonic() - t)\n"
    )
    proc = run_in(login, [sys.executable, "-c", code], timeout=timeout + 30)
    if proc.returncode != 0:
        return None
    return float(proc.stdout.strip())


def is_cut(login: Login, port: int, *, timeout: float = 2.0, whole_link: bool = False) -> bool:
    """True if the login cannot reach the database port (a connect times out) and, for a
    database-only cut, can still reach slurmctld (the cut is that narrow)."""
    if connect_time(login, HA_BRIDGE_ADDR, port, timeout=timeout) is not None:
        return False
    if whole_link:
        return True
    return connect_time(login, DEV_GATEWAY, SLURMCTLD_PORT, timeout=timeout) is not None


def local_connect_time(host: str, port: int, *, timeout: float = 3.0) -> float | None:
    """As `connect_time`, from this namespace."""
    t = time.monotonic()
    try:
        socket.create_connection((host, port), timeout).close()
    except OSError:
        return None
    return time.monotonic() - t
