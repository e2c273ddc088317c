"""The ``[journal]`` table (`core.journal.url`): SQLite by default, PostgreSQL URLs and
their refusals (never showing a password), the password file's rules and the link
settings."""

from __future__ import annotations

import stat

import pytest

from llmd_supervisor.core.journal.url import (
    LINK_SETTINGS,
    PostgresJournal,
    SqliteJournal,
    parse_journal,
    password_file_problem,
)
from llmd_supervisor.errors import ConfigError, ConfigErrors


def pg(url: str, **extra: object) -> PostgresJournal:
    backend = parse_journal({"url": url, **extra})
    assert isinstance(backend, PostgresJournal)
    return backend


def refusal(table: dict[str, object]) -> ConfigErrors:
    with pytest.raises(ConfigErrors) as info:
        parse_journal(table)
    return info.value


def test_sqlite_is_the_default() -> None:
    assert parse_journal({}) == SqliteJournal()


@pytest.mark.parametrize(
    ("url", "hosts", "dbname", "user", "sslmode"),
    [
        ("postgresql://llmd@localhost/llmd", (("localhost", 5432),), "llmd", "llmd", "prefer"),
        ("postgres://llmd@127.0.0.1:6543/j", (("127.0.0.1", 6543),), "j", "llmd", "prefer"),
        ("postgresql://llmd@[::1]:5433/j", (("::1", 5433),), "j", "llmd", "prefer"),
        (
            "postgresql://llmd@%2Frun%2Fpostgresql/j",
            (("/run/postgresql", 5432),),
            "j",
            "llmd",
            "prefer",
        ),
        (
            "postgresql://llmd@db.example.org/llmd",
            (("db.example.org", 5432),),
            "llmd",
            "llmd",
            "verify-full",
        ),
        (
            "postgresql://svc%2Bllmd@db1:5432,db2:5433/team%20journal?sslmode=verify-full",
            (("db1", 5432), ("db2", 5433)),
            "team journal",
            "svc+llmd",
            "verify-full",
        ),
        (
            "postgresql://llmd@[::1]/j?sslmode=verify-ca",
            (("::1", 5432),),
            "j",
            "llmd",
            "verify-ca",
        ),
    ],
)
def test_urls(
    url: str, hosts: tuple[tuple[str, int], ...], dbname: str, user: str, sslmode: str
) -> None:
    j = pg(url)
    assert (j.hosts, j.dbname, j.user, j.sslmode, j.url) == (hosts, dbname, user, sslmode, url)
    assert j.password_file is None


def test_conninfo_has_the_link_settings_and_never_a_password() -> None:
    j = pg(
        "postgresql://llmd@db1,db2:5433/llmd?sslrootcert=/etc/llmd/ca.pem",
        password_file="/etc/llmd/db-password",
    )
    info = j.conninfo()
    assert info == {
        "host": "db1,db2",
        "port": "5432,5433",
        "dbname": "llmd",
        "user": "llmd",
        "sslmode": "verify-full",
        "sslrootcert": "/etc/llmd/ca.pem",
        "application_name": "llmd-supervisor",
        "target_session_attrs": "read-write",
        **LINK_SETTINGS,
    }
    assert "password" not in info and j.password_file == "/etc/llmd/db-password"
    assert "target_session_attrs" not in pg("postgresql://llmd@localhost/llmd").conninfo()
    assert pg("postgresql://u@localhost/d?application_name=x").conninfo()["application_name"] == "x"


def test_a_dead_peer_is_noticed_within_ten_seconds() -> None:
    s = {k: int(v) for k, v in LINK_SETTINGS.items()}
    assert s["keepalives"] == 1
    idle_detect = s["keepalives_idle"] + s["keepalives_count"] * s["keepalives_interval"]
    assert idle_detect <= 10
    assert s["tcp_user_timeout"] <= 10_000
    assert 2 <= s["connect_timeout"] <= 10  # libpq treats less than 2 s as 2 s


SECRET = "hunter2"
REFUSED = [
    (
        "password in the URL",
        {"url": f"postgresql://llmd:{SECRET}@db/llmd"},
        "'postgresql://llmd:***@db/llmd'",
        "journal.password_file",
    ),
    (
        "password as a parameter",
        {"url": f"postgresql://llmd@db/llmd?sslmode=require&password={SECRET}"},
        "'postgresql://llmd@db/llmd?sslmode=require&password=***'",
        "journal.password_file",
    ),
    (
        "password without a scheme",
        {"url": f"llmd:{SECRET}@db/llmd"},
        "'llmd:***@db/llmd'",
        "journal.password_file",
    ),
    ("not a URL", {"url": "journal.sqlite3"}, "'journal.sqlite3'", "leave journal.url unset"),
    ("not a string", {"url": 5432}, "value 5432:", "postgresql://"),
    ("another scheme", {"url": "mysql://u@h/d"}, "'mysql://u@h/d'", "scheme 'mysql'"),
    ("no user", {"url": "postgresql://localhost/llmd"}, "localhost", "name the database role"),
    ("no database", {"url": "postgresql://u@localhost"}, "localhost", "name the database"),
    ("empty database", {"url": "postgresql://u@localhost/"}, "localhost", "name the database"),
    ("empty host", {"url": "postgresql://u@db1,/d?sslmode=require"}, "db1", "is empty"),
    ("bad port", {"url": "postgresql://u@localhost:0/d"}, "localhost", "from 1 to 65535"),
    ("port not a number", {"url": "postgresql://u@localhost:pg/d"}, "localhost", "'pg'"),
    ("bad IPv6", {"url": "postgresql://u@[::1/d"}, "[::1", "[IPv6]"),
    ("bad sslmode", {"url": "postgresql://u@localhost/d?sslmode=on"}, "on", "is not one of"),
    (
        "unencrypted to a remote host",
        {"url": "postgresql://u@localhost,db.example.org/d?sslmode=prefer"},
        "db.example.org",
        "sslmode=verify-full",
    ),
    (
        "unverified to a remote host",
        {"url": "postgresql://u@[2001:db8::5]/d?sslmode=require"},
        "sslmode=require to 2001:db8::5",
        "use sslmode=verify-full",
    ),
    (
        "a link setting",
        {"url": "postgresql://u@localhost/d?keepalives_idle=60"},
        "keepalives_idle",
        "remove keepalives_idle from the URL",
    ),
    ("unknown parameter", {"url": "postgresql://u@localhost/d?host=x"}, "'host'", "allowed:"),
    (
        "bad target",
        {"url": "postgresql://u@a,b/d?target_session_attrs=rw"},
        "'rw'",
        "target_session_attrs",
    ),
    ("unknown key", {"uri": "postgresql://u@localhost/d"}, "journal.uri", "allowed here: url"),
    (
        "relative password file",
        {"url": "postgresql://u@localhost/d", "password_file": "pw"},
        "journal.password_file",
        "absolute path",
    ),
    (
        "password file without a URL",
        {"password_file": "/etc/llmd/pw"},
        "journal.password_file",
        "only used with a postgresql://",
    ),
]


@pytest.mark.parametrize(
    ("table", "shown", "fix"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_refusals(table: dict[str, object], shown: str, fix: str) -> None:
    error = refusal(table)
    message = str(error)
    assert len(error.problems) == 1
    assert message.startswith("Configuration key 'journal.")
    assert shown in message and fix in message
    assert SECRET not in message and SECRET not in repr(error.value)


def test_every_problem_is_reported() -> None:
    error = refusal({"url": "mysql://x", "password_file": "rel", "extra": 1})
    assert [p.key for p in error.problems] == [
        "journal.extra",
        "journal.password_file",
        "journal.url",
    ]
    assert all(isinstance(p, ConfigError) for p in error.problems)


REG = stat.S_IFREG
FILES = [
    ("owner only", REG | 0o600, 990, None),
    ("owner read only", REG | 0o400, 990, None),
    ("root's, owner only (systemd credentials)", REG | 0o400, 0, None),
    ("group readable", REG | 0o640, 990, "mode 0640, which lets group or others"),
    ("other readable", REG | 0o604, 990, "mode 0604"),
    ("group writable", REG | 0o620, 990, "mode 0620"),
    ("another user's", REG | 0o600, 1001, "owned by uid 1001, not by the daemon's"),
    ("a directory", stat.S_IFDIR | 0o700, 990, "is not a regular file"),
    ("a FIFO", stat.S_IFIFO | 0o600, 990, "is not a regular file"),
]


@pytest.mark.parametrize(
    ("mode", "uid", "problem"), [f[1:] for f in FILES], ids=[f[0] for f in FILES]
)
def test_password_file_rules(mode: int, uid: int, problem: str | None) -> None:
    found = password_file_problem("/etc/llmd/db-password", mode, uid, 990)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found
        assert found.startswith("/etc/llmd/db-password ")


# Every spelling of a secret in a journal URL (issue 4.1, item 8): libpq decodes a query
# key before it looks it up, so a key is judged decoded, and the refusal shows the URL
# with every secret masked, in whatever spelling it came.
SECRET_SPELLINGS = [
    ("percent-encoded key", "postgresql://u@db/d?pass%77ord=hunter2", "password"),
    ("fully encoded key", "postgresql://u@db/d?%70%61%73%73%77%6f%72%64=hunter2", "password"),
    ("percent-encoded value", "postgresql://u@db/d?password=hunter%32", "password"),
    ("upper case", "postgresql://u@db/d?PASSWORD=hunter2", "password"),
    ("mixed case", "postgresql://u@db/d?sslmode=require&PassWord=hunter2", "password"),
    ("sslpassword", "postgresql://u@db/d?sslkey=/k.pem&sslpassword=hunter2", "sslpassword"),
    ("encoded sslpassword", "postgresql://u@db/d?SSL%50assword=hunter2", "sslpassword"),
    ("userinfo", "postgresql://u:hunter2@db/d", "user:password@"),
    ("userinfo, encoded", "postgresql://u:hunter%32@db/d", "user:password@"),
    ("userinfo with @", "postgresql://u:hun@ter2@db/d", "user:password@"),
    ("repeated key", "postgresql://u@db/d?password=x&password=hunter2", "password"),
    ("repeated, spelled twice", "postgresql://u@db/d?password=a&pass%77ord=hunter2", "password"),
    ("key and value in one", "postgresql://u@db/d?password%3Dhunter2", "password"),
    ("blank value", "postgresql://u@db/d?password=&sslmode=require", "password"),
]


@pytest.mark.parametrize(
    ("url", "named"), [s[1:] for s in SECRET_SPELLINGS], ids=[s[0] for s in SECRET_SPELLINGS]
)
def test_a_secret_in_any_spelling_is_refused_and_never_shown(url: str, named: str) -> None:
    error = refusal({"url": url})
    message = str(error)
    assert len(error.problems) == 1 and error.key == "journal.url"
    assert "holds a" in message and named in message, message
    for shown in ("hunter2", "hunter%32", "hun@ter2", "%3Dhunter2"):
        assert shown not in message and shown not in repr(error.value), message
    assert "postgresql://u" in message  # the URL is still named, masked


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@db/d?sslmode=require&X%3Dhunter2=1",
        "postgresql://u@db/d?sslmode=require&hunter2%26=1",
        "postgresql://u@db/d?sslmode=require&Hunter2x",
    ],
)
def test_an_unknown_parameter_is_refused_without_echoing_what_it_may_hide(url: str) -> None:
    message = str(refusal({"url": url}))
    assert "not supported here" in message and "hunter2" not in message.lower(), message


def test_a_decoded_allowed_key_is_the_key() -> None:
    assert pg("postgresql://u@localhost/d?ssl%6Dode=require").sslmode == "require"
