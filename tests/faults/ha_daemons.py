"""The rig of the two-daemon fault tests (issue 3.7): the two logins of tests/ha_net.py,
a PostgreSQL server on 10.78.0.1 that both reach, and daemons started inside a login with
their journal on that server.

    with ha_rig(cluster) as rig:
        db = rig.pg.new_database()
        d1 = login_daemon(rig, "login1", tmp_path / "d1", db)
        d2 = login_daemon(rig, "login2", tmp_path / "d2", db)
        d1.start(); d2.start()
        ...
        cut(rig.net.login("login1"), net=rig.net)   # its database link, for 30 s
        restart_immediate(rig.pg)                   # PostgreSQL restarted
        parse_lease_events("login1", d1.log_text().splitlines())  # tests/faults/ha_trials.py

The rig stops the daemons the test started (tests.daemon_helpers.stop_started) before it
tears the network down, so none is SIGKILLed by the teardown; the network's teardown then
checks that nothing of it is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.daemon_helpers import Daemon, stop_started
from tests.devcluster import DevCluster
from tests.ha_net import HA_BRIDGE_ADDR, HA_SUBNET, HaNet, HaNetError, ha_network, leftovers
from tests.postgres import PgServer, start_server, stop_server

__all__ = ["HaRig", "ha_rig", "journal_config", "login_daemon"]


@dataclass
class HaRig:
    net: HaNet
    pg: PgServer
    cluster: DevCluster


@contextmanager
def ha_rig(cluster: DevCluster, *, durable: bool = True) -> Iterator[HaRig]:
    """The logins and a PostgreSQL server on 10.78.0.1 and 127.0.0.1 (`durable`: with
    synchronous_commit on, as a production journal; TLS with a CA of its own, which the
    journal's URL requires for a non-loopback host); all of it gone afterwards."""
    with ha_network(nodes=cluster.nodes) as net:
        pg = start_server(
            listen=("127.0.0.1", HA_BRIDGE_ADDR), hba=(HA_SUBNET,), durable=durable, tls=True
        )
        net.db_port = pg.port
        try:
            yield HaRig(net, pg, cluster)
        finally:
            stop_started()
            stop_server(pg)
    left = leftovers(cluster.nodes)
    if left:
        raise HaNetError(f"the two-login rig left {', '.join(left)}")


def journal_config(pg: PgServer, dbname: str) -> str:
    """The daemon's [journal] table for a database of the rig's server, at 10.78.0.1."""
    return (
        "[journal]\n"
        f'url = "{pg.url(dbname, HA_BRIDGE_ADDR)}?{pg.tls_query()}"\n'
        f'password_file = "{pg.password_file}"\n'
    )


def login_daemon(
    rig: HaRig, login: str, root: Path, dbname: str, *, extra_config: str = "", **kwargs: object
) -> Daemon:
    """A daemon (not started) that runs in `login`, its journal the rig's `dbname`."""
    root.mkdir(parents=True, exist_ok=True)
    return Daemon(
        rig.cluster,
        root,
        extra_config=journal_config(rig.pg, dbname) + extra_config,
        prefix=rig.net.login(login).enter(),
        **kwargs,  # type: ignore[arg-type]  # Daemon's other fields
    )
