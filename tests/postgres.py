"""A real PostgreSQL for the journal tests (pytest plugin of tests/conftest.py).

One server per test session (per xdist worker): Debian's PostgreSQL 15 binaries
(deploy/install-dev.sh installs ``postgresql``), a cluster initialised in a temporary
directory as the ``postgres`` user (as the test user when the tests do not run as root),
``fsync`` off, listening on 127.0.0.1 only on a free port and on a Unix socket in that
directory. The journal's role ``llmd`` logs in over TCP with a password (scram-sha-256)
read from a 0600 password file, as a daemon's would; each test gets a database of its
own. The server is stopped by its PID at the end (SIGINT: fast shutdown), never by name.

Missing binaries skip the PostgreSQL half of a test, which LLMD_TEST_NO_SKIP=1 (CI)
turns into a failure (tests/conftest.py).

`journal_target` parametrises a test over both backends: ``[sqlite]`` and
``[postgresql]`` (the session's shared journal database, emptied for each test; a test
of the schema or of migrations takes `pg`, the config of a new database of its own).

A PostgreSQL journal refuses writes that do not come from its cluster's current leader
(`core.ha.fencing`). `JournalTarget.open` makes the tests' journal a leader: `lead_for_tests`
holds the lease of `TEST_CLUSTER` until far in the future and makes its epoch the
journal's default writer. A test that opens a PostgreSQL journal otherwise calls it too.
"""

from __future__ import annotations

import itertools
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from llmd_supervisor.adapters.journal.db import Db
from llmd_supervisor.adapters.journal.pg import PostgresSettings
from llmd_supervisor.adapters.journal.schema import TABLES
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.core.ha.fencing import Writer
from llmd_supervisor.core.ha.lease import LEASE_TABLE
from llmd_supervisor.core.journal.url import PostgresJournal, parse_journal

__all__ = [
    "TEST_CLUSTER",
    "JournalTarget",
    "PgServer",
    "journal_target",
    "lead_for_tests",
    "postgres",
    "restart_immediate",
    "start_server",
    "stop_server",
]

PG_BIN = Path(os.environ.get("LLMD_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
ROLE = "llmd"
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 20.0


@dataclass
class PgServer:
    """The session's PostgreSQL server."""

    base: Path  # its directory: data/, the Unix socket, the log, the password file
    port: int
    password_file: Path
    process: subprocess.Popen[bytes]
    _databases: Iterator[int]
    _shared: tuple[str, psycopg.Connection[tuple[object, ...]]] | None = None
    listen: tuple[str, ...] = ("127.0.0.1",)  # the addresses it listens on
    durable: bool = False  # synchronous_commit on (start_server)
    ca_file: Path | None = None  # the CA of its TLS certificate (start_server(tls=True))

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        """A superuser connection over the Unix socket (autocommit); close it after use."""
        return psycopg.connect(
            host=str(self.base), port=self.port, user="postgres", dbname="postgres", autocommit=True
        )

    def url(self, dbname: str, host: str = "127.0.0.1") -> str:
        return f"postgresql://{ROLE}@{host}:{self.port}/{dbname}"

    def tls_query(self) -> str:
        """The URL query that makes a client verify this server's certificate."""
        assert self.ca_file is not None, "started without tls"
        return f"sslmode=verify-full&sslrootcert={self.ca_file}"

    def password(self) -> str:
        return self.password_file.read_text().strip()

    def journal_config(self, dbname: str) -> PostgresJournal:
        backend = parse_journal({"url": self.url(dbname), "password_file": str(self.password_file)})
        assert isinstance(backend, PostgresJournal)
        return backend

    def new_database(self) -> str:
        """A new, empty database owned by the journal's role."""
        name = f"j{next(self._databases)}"
        with self.admin() as conn:
            conn.execute(f"CREATE DATABASE {name} OWNER {ROLE} TEMPLATE template0")
        return name

    def emptied_database(self) -> str:
        """The session's shared journal database, its journal tables emptied (a tenth of
        the time of a new database and a migration, which `new_database` is for)."""
        if self._shared is None:
            name = self.new_database()
            self._shared = (
                name,
                psycopg.connect(
                    host=str(self.base),
                    port=self.port,
                    user="postgres",
                    dbname=name,
                    autocommit=True,
                ),
            )
        name, conn = self._shared
        made = conn.execute("SELECT to_regclass('runs') IS NOT NULL").fetchone()
        if made is not None and made[0]:
            conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY")
        return name

    def close(self) -> None:
        if self._shared is not None:
            self._shared[1].close()
            self._shared = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = (self.base / "server.log").read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres() -> dict[str, object]:
    """Popen arguments that run a command as the postgres user (root), or as us."""
    if os.geteuid() != 0:
        return {}
    pw = pwd.getpwnam("postgres")
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgServer]:
    """The session's PostgreSQL server (started here, stopped by PID at the end)."""
    if not (PG_BIN / "initdb").is_file():
        pytest.skip(f"PostgreSQL is not installed ({PG_BIN}/initdb); deploy/install-dev.sh")
    server = start_server()
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture
def pg(postgres: PgServer) -> PostgresJournal:
    """The journal config of a new, empty database of the session's server."""
    return postgres.journal_config(postgres.new_database())


def start_server(
    listen: tuple[str, ...] = ("127.0.0.1",),
    hba: tuple[str, ...] = (),
    *,
    durable: bool = False,
    tls: bool = False,
) -> PgServer:
    """A new PostgreSQL server: a cluster initialised in a temporary directory as the
    postgres user, listening on the addresses `listen` (each must exist) on a free port,
    with the journal's role (scram-sha-256 over TCP from loopback and from the networks
    `hba`, e.g. ``("10.78.0.0/24",)``). `stop_server` stops it and removes its directory.

    Not `durable` (the session's server): ``synchronous_commit=off``, so a commit
    acknowledged less than ~0.2 s (wal_writer_delay) before `restart_immediate` can be
    lost. `durable` keeps PostgreSQL's default (on), as a production journal has: what a
    client saw committed survives the restart. ``fsync`` is off either way (the machine
    does not crash in these tests).

    `tls`: the server speaks TLS (``ssl=on``) with a certificate for its `listen`
    addresses signed by a CA of its own (`PgServer.ca_file`), so a daemon can reach it
    over a non-loopback address with ``sslmode=verify-full`` (which the journal's URL
    requires there; `PgServer.tls_query`)."""
    if not (PG_BIN / "initdb").is_file():
        pytest.fail(f"PostgreSQL is not installed ({PG_BIN}/initdb); deploy/install-dev.sh")
    base = Path(tempfile.mkdtemp(prefix="llmd-pg-"))
    as_postgres = _as_postgres()
    try:
        if as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(base, pw.pw_uid, pw.pw_gid)
        initdb = subprocess.run(
            [
                str(PG_BIN / "initdb"),
                "-D",
                str(base / "data"),
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "--no-sync",
                "--no-instructions",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=base,
            **as_postgres,  # type: ignore[call-overload]  # user/group/extra_groups
        )
        if initdb.returncode != 0:
            pytest.fail(f"initdb failed ({initdb.returncode}):\n{initdb.stdout}{initdb.stderr}")
        if hba:
            with open(base / "data" / "pg_hba.conf", "a") as f:
                f.writelines(f"host all all {net} scram-sha-256\n" for net in hba)
        if tls:
            _make_tls(base, listen, as_postgres)
        port = _free_port()
        process = _spawn(base, port, listen, durable)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    password = secrets.token_urlsafe(16)
    password_file = base / "password"
    fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, f"{password}\n".encode())
    os.close(fd)
    server = PgServer(
        base,
        port,
        password_file,
        process,
        itertools.count(1),
        listen=listen,
        durable=durable,
        ca_file=base / "tls" / "ca.crt" if tls else None,
    )
    try:
        _wait_ready(server)
        with server.admin() as conn:
            conn.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{password}'")
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: PgServer) -> None:
    """Stop the server by its PID (fast shutdown) and remove its directory."""
    try:
        server.close()
        _stop(server)
    finally:
        shutil.rmtree(server.base, ignore_errors=True)


def restart_immediate(server: PgServer) -> float:
    """The 'PostgreSQL restarted' fault: an immediate shutdown (SIGQUIT to the postmaster:
    every backend ends at once, no checkpoint, as after a crash), then the server started
    again on the same data directory, addresses and port, and waited for (crash recovery
    included). Returns the seconds from the SIGQUIT until it accepted connections again."""
    server.close()  # the shared connection dies with the server
    start = time.monotonic()
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGQUIT)
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(_STOP_TIMEOUT_S)
    server.process = _spawn(server.base, server.port, server.listen, server.durable)
    _wait_ready(server)
    return time.monotonic() - start


def _make_tls(base: Path, addrs: tuple[str, ...], as_postgres: dict[str, object]) -> None:
    """A CA and a server certificate for `addrs` (and localhost) under base/tls; the key
    readable by the server's user only."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    tls_dir = base / "tls"
    tls_dir.mkdir(mode=0o755)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmd test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in addrs]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, addrs[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (tls_dir / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tls_dir / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file = tls_dir / "server.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(
        fd,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        ),
    )
    os.close(fd)
    if as_postgres:
        pw = pwd.getpwnam("postgres")
        os.chown(key_file, pw.pw_uid, pw.pw_gid)


def _spawn(
    base: Path, port: int, listen: tuple[str, ...], durable: bool
) -> subprocess.Popen[bytes]:
    """Start the postmaster of the cluster in `base` (as the postgres user when root)."""
    tls_dir = base / "tls"
    tls_args = (
        [
            "-c",
            "ssl=on",
            "-c",
            f"ssl_cert_file={tls_dir / 'server.crt'}",
            "-c",
            f"ssl_key_file={tls_dir / 'server.key'}",
        ]
        if (tls_dir / "server.key").exists()
        else []
    )
    log = open(base / "server.log", "ab")  # noqa: SIM115  # the server writes it until the end
    try:
        process: subprocess.Popen[bytes] = subprocess.Popen(
            [
                str(PG_BIN / "postgres"),
                "-D",
                str(base / "data"),
                "-p",
                str(port),
                "-c",
                f"listen_addresses={','.join(listen)}",
                "-c",
                f"unix_socket_directories={base}",
                "-c",
                "fsync=off",
                "-c",
                f"synchronous_commit={'on' if durable else 'off'}",
                "-c",
                "full_page_writes=off",
                "-c",
                "shared_buffers=32MB",
                "-c",
                "max_connections=80",
                *tls_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=base,
            start_new_session=True,
            **_as_postgres(),  # type: ignore[call-overload]  # user/group/extra_groups
        )
    finally:
        log.close()
    return process


def _wait_ready(server: PgServer) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        if server.process.poll() is not None:
            pytest.fail(
                f"PostgreSQL exited at start ({server.process.returncode}):\n{server.log_tail()}"
            )
        try:
            server.admin().close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"PostgreSQL did not accept connections in {_START_TIMEOUT_S:g} s:\n"
                    f"{server.log_tail()}"
                )
            time.sleep(0.05)


def _stop(server: PgServer) -> None:
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGINT)  # fast shutdown: roll back and disconnect
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()  # the postmaster only; its children exit when it is gone
            process.wait(_STOP_TIMEOUT_S)


# The pseudo cluster the tests' journals write as (no daemon of a test leads it), and its
# holder: a maintenance writer (core.ha.fencing.MAINTENANCE_PREFIX), which may write the rows
# of every cluster the tests use.
TEST_CLUSTER = "@journal-tests"
_TEST_HOLDER = "tests/postgres.py"
# Held until far in the future; the epoch is kept when the row exists (a test may have
# moved it on: the journal then writes with the epoch it is at).
_TEST_LEASE_SQL = f"""
INSERT INTO {LEASE_TABLE} AS l (cluster, holder, epoch, expires_at)
VALUES (?, ?, 1, now() + interval '100 years')
ON CONFLICT (cluster) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at
RETURNING epoch
"""


async def lead_for_tests(journal: Journal, cluster: str = TEST_CLUSTER) -> Writer:
    """Make a PostgreSQL journal's writes pass its fence: `cluster`'s lease row, held
    until far in the future, and its epoch as the journal's default writer (returned)."""

    def hold(db: Db) -> int:
        row = db.execute(_TEST_LEASE_SQL, (cluster, _TEST_HOLDER)).fetchone()
        assert row is not None
        return int(str(row[0]))

    # The lease table is not fenced: this write needs no writer.
    writer = Writer(cluster, await journal.write(f"hold the lease of {cluster}", hold))
    journal.set_default_writer(lambda: writer)
    return writer


@dataclass(frozen=True)
class JournalTarget:
    """Where a test's journal lives: an SQLite file, or a database of the session's server."""

    kind: str  # "sqlite" or "postgresql"
    sqlite_path: Path
    postgres: PostgresJournal | None

    @property
    def location(self) -> str:
        return str(self.sqlite_path) if self.postgres is None else self.postgres.url

    async def open(self, settings: PostgresSettings | None = None) -> Journal:
        """The journal, open; on PostgreSQL, writing as `TEST_CLUSTER`'s leader
        (`lead_for_tests`)."""
        if self.postgres is None:
            return await Journal.open(self.sqlite_path)
        journal = await Journal.open_postgres(self.postgres, settings)
        try:
            await lead_for_tests(journal)
        except BaseException:
            await journal.aclose()
            raise
        return journal


@pytest.fixture(params=["sqlite", "postgresql"])
def journal_target(request: pytest.FixtureRequest, tmp_path: Path) -> JournalTarget:
    """A fresh journal location on each backend (the test opens it, as often as it likes)."""
    path = tmp_path / "state" / "journal.sqlite3"
    if request.param == "sqlite":
        return JournalTarget("sqlite", path, None)
    server: PgServer = request.getfixturevalue("postgres")
    return JournalTarget("postgresql", path, server.journal_config(server.emptied_database()))
