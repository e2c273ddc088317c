"""The daemon config's ``[journal]`` table: which journal backend, and how to reach it
(pure: the caller reads the table and stats the password file).

``[journal]`` absent or without ``url``: the SQLite journal in the state directory (the
default; nothing else changes). ``url = "postgresql://USER@HOST[:PORT][,HOST2[:PORT]]/DBNAME
[?sslmode=...]"`` (``postgres://`` too): a shared PostgreSQL journal. The URL never
holds a secret: ``user:password@``, and ``password`` or ``sslpassword`` in the query in
any case or percent-encoding (libpq decodes a key before it looks it up), are refused, and
a refusal shows the URL with every secret and every unknown parameter's value masked. A
password, if the role needs one, is in ``password_file``: an absolute path to a file owned
by the service's account (or root) and not readable, writable or executable by group or others
(`password_file_problem`, libpq's own rule for ``.pgpass``). A host may be a Unix socket
directory, percent-encoded (``postgresql://llmd@%2Frun%2Fpostgresql/llmd``).

The daemon sets the connection options that make a cut link visible in seconds
(`LINK_SETTINGS`); the URL may not set them. Over TCP to any host that is not loopback
the link must be encrypted and the server's certificate checked against its name:
sslmode ``verify-full``, the default there, and a weaker mode (``require``, ``verify-ca``,
...) is refused. Loopback and a Unix socket directory take any mode (``prefer`` by default).
With several hosts, ``target_session_attrs``
defaults to ``read-write`` so the daemon reaches the primary.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import parse_qsl, unquote

from llmd_supervisor.errors import ConfigError, ConfigErrors

__all__ = [
    "DEFAULT_PORT",
    "JOURNAL_KEYS",
    "LINK_SETTINGS",
    "JournalBackend",
    "PostgresJournal",
    "SqliteJournal",
    "parse_journal",
    "password_file_problem",
]

DEFAULT_PORT: Final = 5432
JOURNAL_KEYS: Final = ("url", "password_file")

# libpq settings so that a dead database host or a cut link is noticed in ~10 s:
# - an idle connection sends the first keepalive after 2 s of silence, then one every
#   2 s; after 3 unanswered the kernel drops it: 2 + 3 * 2 = 8 s;
# - data sent and not acknowledged (a statement in flight on a cut link, where
#   keepalives do not run) drops the connection after tcp_user_timeout, 9 s; on Linux
#   it also caps the keepalive case at 9 s;
# - connecting to an unresponsive host gives up after 5 s per host.
# The lease does not rely on these (each lease statement has its own 1.5 s timeout,
# core.ha.lease): they keep the pool from handing out dead connections.
LINK_SETTINGS: Final[Mapping[str, str]] = {
    "keepalives": "1",
    "keepalives_idle": "2",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "9000",  # milliseconds
    "connect_timeout": "5",
}

_SSLMODES: Final = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
_TARGETS: Final = ("any", "read-write", "read-only", "primary", "standby", "prefer-standby")
# Query parameters the URL may carry; everything else is refused by name.
_QUERY_KEYS: Final = (
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslcrl",
    "application_name",
    "target_session_attrs",
)
# The shape of a libpq keyword: a query key of any other shape is never shown.
_KEYWORD: Final = re.compile(r"[a-z_]{1,40}")
_LOOPBACK: Final = ("localhost", "127.0.0.1", "::1")
_URL: Final = "journal.url"
_PASSWORD_FILE: Final = "journal.password_file"


@dataclass(frozen=True)
class SqliteJournal:
    """The embedded journal: the state directory's SQLite file, one daemon."""


@dataclass(frozen=True)
class PostgresJournal:
    """A shared PostgreSQL journal; `conninfo()` holds everything but the password."""

    url: str  # as configured (it holds no password), for messages and logs
    hosts: tuple[tuple[str, int], ...]  # (host or socket directory, port)
    dbname: str
    user: str
    sslmode: str
    options: tuple[tuple[str, str], ...]  # other libpq keywords from the URL, sorted
    password_file: str | None

    def conninfo(self) -> dict[str, str]:
        """libpq keyword -> value (psycopg's ``make_conninfo(**...)``), with
        `LINK_SETTINGS`; the adapter adds ``password`` read from `password_file`."""
        params = {
            "host": ",".join(h for h, _ in self.hosts),
            "port": ",".join(str(p) for _, p in self.hosts),
            "dbname": self.dbname,
            "user": self.user,
            "sslmode": self.sslmode,
            "application_name": "llmd-supervisor",
            **dict(self.options),
            **LINK_SETTINGS,
        }
        if len(self.hosts) > 1:
            params.setdefault("target_session_attrs", "read-write")
        return params


JournalBackend = SqliteJournal | PostgresJournal


def parse_journal(table: Mapping[str, object]) -> JournalBackend:
    """The journal backend the ``[journal]`` table names; ConfigErrors with every problem."""
    problems: list[ConfigError] = []
    for key in table:
        if key not in JOURNAL_KEYS:
            problems.append(
                ConfigError(
                    f"journal.{key}",
                    table[key],
                    f"unknown key; allowed here: {', '.join(JOURNAL_KEYS)}",
                )
            )
    url = table.get("url")
    password_file = table.get("password_file")
    pf: str | None = None
    if password_file is not None:
        try:
            pf = _password_file(password_file)
        except ConfigError as exc:
            problems.append(exc)
    backend: JournalBackend = SqliteJournal()
    if url is None:
        if password_file is not None:
            problems.append(
                ConfigError(
                    _PASSWORD_FILE,
                    password_file,
                    "a password file is only used with a postgresql:// journal.url; set "
                    "journal.url or remove journal.password_file",
                )
            )
    else:
        try:
            backend = _postgres(url, pf)
        except ConfigError as exc:
            problems.append(exc)
    if problems:
        raise ConfigErrors(problems)
    return backend


def password_file_problem(path: str, st_mode: int, st_uid: int, service_uid: int) -> str | None:
    """What is wrong with the password file at `path` as `stat` described it, as a
    phrase for ConfigError's hint (None: it is usable)."""
    if not stat.S_ISREG(st_mode):
        return f"{path} is not a regular file; point journal.password_file at one"
    if st_uid not in (service_uid, 0):
        return (
            f"{path} is owned by uid {st_uid}, not by the daemon's account (uid "
            f"{service_uid}) or root; chown it to the daemon's account"
        )
    loose = stat.S_IMODE(st_mode) & (stat.S_IRWXG | stat.S_IRWXO)
    if loose:
        return (
            f"{path} has mode {stat.S_IMODE(st_mode):04o}, which lets group or others "
            f"access it; chmod 0600 {path}"
        )
    return None


def _password_file(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(
            _PASSWORD_FILE,
            value,
            "use an absolute path to a file holding only the database password, readable "
            "by the daemon's account alone (mode 0600)",
        )
    return value


def _refuse(value: str, hint: str) -> ConfigError:
    return ConfigError(_URL, _redacted(value), hint)


def _param_key(pair: str) -> str:
    """The libpq keyword of one ``key=value`` of a URL's query: percent-decoded, as libpq
    decodes it before looking it up."""
    return unquote(pair.partition("=")[0])


def _secret_key(key: str) -> bool:
    """Whether a (decoded) query key names a secret, in any case (``password``,
    ``sslpassword``)."""
    return "password" in key.casefold()


def _shown_key(key: str) -> str | None:
    """A decoded query key as it may be shown in a message: only the shape of a libpq
    keyword (None: anything else, which may be a pasted secret)."""
    return key if _KEYWORD.fullmatch(key) else None


def _userinfo_password(url: str) -> bool:
    """Whether the URL's user information (before the last ``@`` ahead of its query) holds
    a password (``user:password``; libpq splits at the first ``:`` before decoding)."""
    userinfo, at, _ = url.partition("?")[0].rpartition("://")[2].rpartition("@")
    return bool(at) and ":" in userinfo


def _secrets(url: str) -> list[str]:
    """Where `url` holds a secret, as phrases naming the place and never the secret."""
    found = ["user:password@ before the host"] if _userinfo_password(url) else []
    for pair in url.partition("?")[2].split("&"):
        key = _param_key(pair)
        if _secret_key(key):
            shown = _shown_key(key.casefold()) or "password"
            where = f"the parameter {shown}"
            if where not in found:
                found.append(where)
    return found


def _redacted(url: str) -> str:
    """`url` as a message may show it: a password (``user:password@``), the value of any
    query key that is not an allowed libpq keyword and every key that is not shaped like
    one shown as ``***``, however the URL spelled them (percent-encoded, upper case)."""
    head, q, query = url.partition("?")
    scheme, sep, rest = head.rpartition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    pairs = []
    for pair in query.split("&") if q else ():
        key = _param_key(pair)
        if key in _QUERY_KEYS or key in LINK_SETTINGS:
            pairs.append(pair)
        else:
            shown = _shown_key(key.casefold() if _secret_key(key) else key)
            pairs.append("***" if shown is None else f"{shown}=***")
    return f"{scheme}{sep}{rest}{q}{'&'.join(pairs)}"


def _postgres(value: object, password_file: str | None) -> PostgresJournal:
    secrets = _secrets(value) if isinstance(value, str) else []
    if isinstance(value, str) and secrets:
        places = " and ".join(secrets)
        if any("sslpassword" in s for s in secrets):
            fix = (
                "remove it; the daemon reads a client key (sslkey) that needs no passphrase, "
                "in a file of mode 0600 owned by the daemon's account"
            )
        else:
            fix = (
                "remove it from the URL and put it in a file named by journal.password_file "
                "(mode 0600, owned by the daemon's account)"
            )
        raise _refuse(value, f"the URL holds a secret ({places}); {fix}")
    if not isinstance(value, str) or "://" not in value:
        raise ConfigError(
            _URL,
            _redacted(value) if isinstance(value, str) else value,
            'use a PostgreSQL URL such as "postgresql://llmd@db.example.org/llmd", or '
            "leave journal.url unset for the SQLite journal in the state directory",
        )
    scheme, rest = value.split("://", 1)
    if scheme not in ("postgresql", "postgres"):
        raise _refuse(
            value,
            f"the scheme {scheme!r} is not a journal; use postgresql://..., or leave "
            "journal.url unset for the SQLite journal in the state directory",
        )
    rest, _, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    userinfo, at, hostlist = authority.rpartition("@")
    if not at:
        userinfo, hostlist = "", authority
    params: dict[str, str] = {}
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k in LINK_SETTINGS:
            raise _refuse(
                value,
                f"{k} is set by llmd-supervisor so that a cut link is noticed in seconds; "
                f"remove {k} from the URL",
            )
        if k not in _QUERY_KEYS:
            shown = _shown_key(k)
            named = (
                "a parameter not shaped like a keyword"
                if shown is None
                else f"the parameter {shown!r}"
            )
            raise _refuse(
                value,
                f"{named} is not supported here; allowed: {', '.join(_QUERY_KEYS)} "
                "(host, port, user and database go in the URL itself)",
            )
        params[k] = v
    user = unquote(userinfo)
    if not user:
        raise _refuse(
            value, "name the database role before the host, as in postgresql://llmd@host/db"
        )
    dbname = unquote(path) if slash else ""
    if not dbname:
        raise _refuse(value, "name the database after the host, as in postgresql://llmd@host/llmd")
    hosts = tuple(_host(value, h) for h in hostlist.split(","))
    sslmode = params.pop("sslmode", None)
    remote = [h for h, _ in hosts if not h.startswith("/") and h not in _LOOPBACK]
    if sslmode is None:
        sslmode = "verify-full" if remote else "prefer"
    elif sslmode not in _SSLMODES:
        raise _refuse(value, f"sslmode {sslmode!r} is not one of {', '.join(_SSLMODES)}")
    elif remote and sslmode != "verify-full":
        raise _refuse(
            value,
            f"sslmode={sslmode} to {remote[0]} does not check that the server is the one the URL"
            " names, and anything weaker than verify-full is refused for a host other than"
            " loopback or a Unix socket directory; use sslmode=verify-full (the default),"
            " with sslrootcert=/path/to/the-ca.pem naming the CA that signed the server's"
            " certificate (libpq's default: ~/.postgresql/root.crt of the daemon's account)",
        )
    target = params.get("target_session_attrs")
    if target is not None and target not in _TARGETS:
        raise _refuse(value, f"target_session_attrs {target!r} is not one of {', '.join(_TARGETS)}")
    return PostgresJournal(
        url=value,
        hosts=hosts,
        dbname=dbname,
        user=user,
        sslmode=sslmode,
        options=tuple(sorted(params.items())),
        password_file=password_file,
    )


def _host(url: str, text: str) -> tuple[str, int]:
    """One ``host[:port]`` of the URL's host list (IPv6 in brackets)."""
    if text.startswith("["):
        end = text.find("]")
        host, tail = text[1:end], text[end + 1 :]
        if end < 0 or (tail and not tail.startswith(":")):
            raise _refuse(url, f"the host {text!r} is not [IPv6] or [IPv6]:port")
        port_text = tail[1:] if tail else ""
    else:
        host, _, port_text = text.partition(":")
        host = unquote(host)
    if not host:
        raise _refuse(url, "a host of the URL is empty; name each host, separated by commas")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise _refuse(url, f"the port {port_text!r} of {host} is not a number from 1 to 65535")
    return host, int(port_text)
