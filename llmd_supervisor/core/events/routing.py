"""Where events go: the daemon config's destinations and the routing rule (pure).

Destinations live in the daemon's config only::

    [[events.destination]]
    name = "ci"                       # [A-Za-z0-9][A-Za-z0-9_-]{0,63}, unique
    kind = "webhook"                  # webhook | slack | mail
    url = "https://ci.example/hooks/llmd"        # webhook and slack
    secret_file = "/etc/llmd-supervisor/ci.whsec"  # webhook only, and required
    types = ["run.finished", "campaign.finished"]  # default []: every type
    owners = []                       # user names or uids; default []: everyone's
    opt_in = false                    # true: only runs whose spec names this destination

    [[events.destination]]
    name = "oncall"
    kind = "mail"
    to = ["oncall@example.org"]       # mail only, and required
    from = "llmd@login1.example.org"  # optional (default: the daemon's)

A run spec may name configured destinations (`parse_named`, `check_named`), never a URL
or an address: the daemon only ever sends to what its operator wrote here, so no user can
make it request an address of their choosing.

`routes(event, destinations, named, disabled)` lists the destinations an event goes to:
a destination takes an event when its type is in ``types`` (or ``types`` is empty), its
owner is in ``owners`` (or ``owners`` is empty; an event of nobody's, such as a node
quarantined for everyone, only goes where ``owners`` is empty), the spec named it if it
is ``opt_in``, and it is not disabled (a 410 Gone answer disables a destination).
``test.ping`` is never routed: ``events test DEST`` sends it to DEST alone.

Webhook and Slack URLs are https (plain http only to a loopback host, for local
receivers); a URL with a user or password is refused. A Slack webhook URL is itself a
credential: `Destination` never shows it (`shown_url`), nor does any error message.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, TypeVar
from urllib.parse import urlsplit

from llmd_supervisor.core.events.model import Event, EventType, Owner
from llmd_supervisor.errors import ConfigError, ConfigErrors, SpecError

__all__ = [
    "Destination",
    "DestinationKind",
    "EventsConfig",
    "check_named",
    "parse_events",
    "parse_named",
    "proxy_for",
    "routes",
    "shown_proxy",
    "shown_url",
]

_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_USER: Final = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}\$?")
_LABEL: Final = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
# A plain address: a local part without spaces or the characters of a display name, a
# group or a list; then a host name.
_ADDRESS: Final = re.compile(rf"[^\s@<>,;:\"()\[\]\\]{{1,64}}@{_LABEL}(?:\.{_LABEL})*")
_LOOPBACK: Final = frozenset({"127.0.0.1", "::1", "localhost"})
DESTINATIONS_MAX: Final = 64
RECIPIENTS_MAX: Final = 50
_COMMON: Final = ("name", "kind", "types", "owners", "opt_in")
ROUTABLE: Final = tuple(t.value for t in EventType if t is not EventType.TEST_PING)
T = TypeVar("T")


class DestinationKind(StrEnum):
    WEBHOOK = "webhook"  # Standard Webhooks signed POST of the event body
    SLACK = "slack"  # Slack incoming webhook (core.events.formats.slack_message)
    MAIL = "mail"  # local sendmail (core.events.formats.mail_message)


_KEYS: Final = {
    DestinationKind.WEBHOOK: (*_COMMON, "url", "secret_file"),
    DestinationKind.SLACK: (*_COMMON, "url"),
    DestinationKind.MAIL: (*_COMMON, "to", "from"),
}


@dataclass(frozen=True)
class Destination:
    """One configured destination (one ``[[events.destination]]`` table)."""

    name: str
    kind: DestinationKind
    url: str | None = field(default=None, repr=False)  # webhook, slack: never shown
    secret_file: str | None = None  # webhook
    to: tuple[str, ...] = ()  # mail
    sender: str | None = None  # mail: From (None: the daemon's default)
    types: frozenset[EventType] = frozenset()  # empty: every routable type
    owners: tuple[str | int, ...] = ()  # user names and uids; empty: everyone's
    opt_in: bool = False

    def takes(self, etype: EventType, owner: Owner | None) -> bool:
        """Whether its type and owner filters let an event of `etype` of `owner` in."""
        if etype is EventType.TEST_PING or (self.types and etype not in self.types):
            return False
        return self.takes_owner(owner)

    def takes_owner(self, owner: Owner | None) -> bool:
        """Whether its owner filter lets the runs of `owner` in (None: nobody's)."""
        if not self.owners:
            return True
        return owner is not None and any(
            o == owner.uid if isinstance(o, int) else o == owner.name for o in self.owners
        )


@dataclass(frozen=True)
class EventsConfig:
    """The ``[events]`` table."""

    destinations: tuple[Destination, ...] = ()
    # The HTTP proxy webhook and Slack deliveries go through (`proxy_for`); None: the
    # environment's (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY), if any. May hold user:password.
    proxy: str | None = field(default=None, repr=False)

    def destination(self, name: str) -> Destination:
        """The destination of that name; ConfigError naming the configured ones."""
        for d in self.destinations:
            if d.name == name:
                return d
        known = ", ".join(d.name for d in self.destinations) or "none is configured"
        raise ConfigError("events.destination", name, f"no destination of that name ({known})")


def routes(
    event: Event,
    destinations: Sequence[Destination],
    named: Collection[str] = (),
    disabled: Collection[str] = (),
) -> list[str]:
    """The names of the destinations `event` goes to, in config order. `named`: the
    destinations the run's (or campaign's) spec names; `disabled`: those disabled by a
    410 answer (journaled)."""
    return [
        d.name
        for d in destinations
        if d.name not in disabled
        and d.takes(event.type, event.owner)
        and (not d.opt_in or d.name in named)
    ]


# --- a spec's side ---------------------------------------------------------------------


def parse_named(value: object, key: str = "notify.destinations") -> tuple[str, ...]:
    """A spec's list of destination names; SpecError for anything that is not a list of
    names (a URL or an address in particular: a spec never carries one)."""
    if not isinstance(value, list):
        raise SpecError(key, value, 'use a list of destination names, e.g. ["team-slack"]')
    names: list[str] = []
    for item in value:
        if isinstance(item, str) and ("://" in item or "@" in item or "/" in item):
            raise SpecError(
                key,
                shown_url(item) if "://" in item else item,
                "a spec names destinations the daemon's operator configured; it never "
                "carries a URL or an address (ask the operator for an [[events.destination]])",
            )
        if not isinstance(item, str) or not _NAME.fullmatch(item):
            raise SpecError(key, item, "a destination name is [A-Za-z0-9][A-Za-z0-9_-]{0,63}")
        if item not in names:
            names.append(item)
    return tuple(names)


def check_named(
    names: Sequence[str],
    owner: Owner | None,
    config: EventsConfig,
    key: str = "notify.destinations",
) -> None:
    """SpecError when a name the spec gives is not configured, or is configured for
    other owners' runs only (the spec cannot widen an operator's ``owners``; None: the
    owner is not known yet, only the names are checked)."""
    known = {d.name: d for d in config.destinations}
    for name in names:
        d = known.get(name)
        if d is None:
            listed = ", ".join(known) or "none is configured"
            raise SpecError(key, name, f"no destination of that name ({listed})")
        if owner is not None and not d.takes_owner(owner):
            raise SpecError(
                key,
                name,
                f"destination {name!r} takes the runs of {_owners(d.owners)} only, not of "
                f"{owner.name or owner.uid}; ask the operator",
            )


def _owners(owners: Sequence[str | int]) -> str:
    return ", ".join(str(o) for o in owners)


# --- the daemon config's side ----------------------------------------------------------


def parse_events(table: Mapping[str, object]) -> EventsConfig:
    """Validate the decoded ``[events]`` table. ConfigErrors lists every problem, each
    naming its key (``events.destination[1].url``), the value and the fix."""
    problems: list[ConfigError] = []
    for key in table:
        if key not in ("destination", "proxy"):
            problems.append(
                ConfigError(
                    f"events.{key}", table[key], "unknown key; allowed here: destination, proxy"
                )
            )
    proxy = None
    if "proxy" in table:
        try:
            proxy = _proxy(table["proxy"])
        except ConfigError as exc:
            problems.append(exc)
    raw = table.get("destination", [])
    if not isinstance(raw, list):
        problems.append(ConfigError("events.destination", raw, "use [[events.destination]] tables"))
        raw = []
    if len(raw) > DESTINATIONS_MAX:
        problems.append(
            ConfigError(
                "events.destination", len(raw), f"configure at most {DESTINATIONS_MAX} of them"
            )
        )
    found: list[tuple[int, Destination]] = []  # (index in the file, destination)
    for i, entry in enumerate(raw):
        prefix = f"events.destination[{i}]"
        if not isinstance(entry, dict):
            problems.append(ConfigError(prefix, entry, "each entry must be a table"))
            continue
        try:
            found.append((i, _destination(prefix, entry)))
        except ConfigErrors as many:
            problems += many.problems
        except ConfigError as exc:
            problems.append(exc)
    seen: set[str] = set()
    for i, d in found:
        if d.name in seen:
            problems.append(
                ConfigError(
                    f"events.destination[{i}].name", d.name, "destination names must be unique"
                )
            )
        seen.add(d.name)
    if problems:
        raise ConfigErrors(problems)
    return EventsConfig(destinations=tuple(d for _, d in found), proxy=proxy)


def _destination(prefix: str, t: Mapping[str, object]) -> Destination:
    problems: list[ConfigError] = []
    name = t.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        problems.append(
            ConfigError(
                f"{prefix}.name",
                name,
                'use 1-64 of letters, digits, - and _ (first: a letter or digit), e.g. "ci"',
            )
        )
    raw_kind = t.get("kind")
    try:
        kind = DestinationKind(raw_kind if isinstance(raw_kind, str) else "")
    except ValueError:
        raise ConfigErrors(
            [*problems, ConfigError(f"{prefix}.kind", raw_kind, "use webhook, slack or mail")]
        ) from None
    for key, value in t.items():
        if key not in _KEYS[kind]:
            problems.append(
                ConfigError(
                    f"{prefix}.{key}",
                    shown_url(value) if key == "url" and isinstance(value, str) else value,
                    f"not a key of a {kind.value} destination; allowed: {', '.join(_KEYS[kind])}",
                )
            )
    found = _Found(problems)
    no_types: frozenset[EventType] = frozenset()
    no_owners: tuple[str | int, ...] = ()
    types = found.check(lambda: _types(prefix, t.get("types", [])), no_types)
    owners = found.check(lambda: _owner_list(prefix, t.get("owners", [])), no_owners)
    opt_in = found.check(lambda: _bool(f"{prefix}.opt_in", t.get("opt_in", False)), False)
    url = secret = sender = None
    to: tuple[str, ...] = ()
    if kind is DestinationKind.MAIL:
        to = found.check(lambda: _recipients(f"{prefix}.to", t.get("to")), ())
        if "from" in t:
            sender = found.check(lambda: _address(f"{prefix}.from", t["from"]), None)
    else:
        url = found.check(lambda: _url(f"{prefix}.url", t.get("url"), kind), None)
        if kind is DestinationKind.WEBHOOK:
            secret_file = t.get("secret_file")
            secret = found.check(lambda: _secret_file(f"{prefix}.secret_file", secret_file), None)
    if problems:
        raise ConfigErrors(problems)
    assert isinstance(name, str)
    return Destination(
        name=name,
        kind=kind,
        url=url,
        secret_file=secret,
        to=to,
        sender=sender,
        types=types,
        owners=owners,
        opt_in=opt_in,
    )


class _Found:
    """Runs each check; a failed one adds its ConfigError to `problems` and gives the
    default, so that one pass reports every problem of a table."""

    def __init__(self, problems: list[ConfigError]) -> None:
        self.problems = problems

    def check(self, parse: Callable[[], T], default: T) -> T:
        try:
            return parse()
        except ConfigError as exc:
            self.problems.append(exc)
            return default


def _types(prefix: str, value: object) -> frozenset[EventType]:
    key = f"{prefix}.types"
    if not isinstance(value, list):
        raise ConfigError(key, value, f"use a list of event types from: {', '.join(ROUTABLE)}")
    types: set[EventType] = set()
    for item in value:
        if item == EventType.TEST_PING.value:
            raise ConfigError(
                key, item, "test.ping is sent only by `events test DEST`; remove it from types"
            )
        if not isinstance(item, str) or item not in ROUTABLE:
            raise ConfigError(key, item, f"not an event type; use one of: {', '.join(ROUTABLE)}")
        types.add(EventType(item))
    return frozenset(types)


def _owner_list(prefix: str, value: object) -> tuple[str | int, ...]:
    key = f"{prefix}.owners"
    hint = 'use a list of user names and uids, e.g. ["alice", 1002] ([]: everyone\'s runs)'
    if not isinstance(value, list):
        raise ConfigError(key, value, hint)
    owners: list[str | int] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise ConfigError(key, item, hint)
        if isinstance(item, int) and not 0 <= item <= 2**32 - 2:
            raise ConfigError(key, item, "a uid is an integer from 0 to 4294967294")
        if isinstance(item, str) and not _USER.fullmatch(item):
            raise ConfigError(key, item, "not a user name (letters, digits, '.', '_', '-')")
        owners.append(item)
    return tuple(owners)


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, value, "use true or false")
    return value


def _url(key: str, value: object, kind: DestinationKind) -> str:
    example = (
        "https://hooks.slack.com/services/..."
        if kind is DestinationKind.SLACK
        else "https://ci.example/hooks/llmd"
    )
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, f"a {kind.value} destination needs its url, e.g. {example}")
    shown = shown_url(value)
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ConfigError(key, shown, "a URL has no spaces or control characters")
    try:
        parts = urlsplit(value)
        host = parts.hostname or ""
        _ = parts.port  # ValueError when it is not a port number
    except ValueError:
        raise ConfigError(key, shown, f"not a URL; use e.g. {example}") from None
    if parts.scheme not in ("https", "http") or not host:
        raise ConfigError(key, shown, f"use an https URL, e.g. {example}")
    if parts.scheme == "http" and host not in _LOOPBACK:
        raise ConfigError(key, shown, "use https (plain http only to 127.0.0.1, ::1 or localhost)")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            key,
            shown,
            "a URL with a user or password is refused; a webhook authenticates the daemon "
            "by its signature (secret_file)",
        )
    if parts.fragment:
        raise ConfigError(key, shown, "remove the #fragment (it is never sent)")
    return value


def _secret_file(key: str, value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(
            key,
            value,
            "a webhook destination needs the absolute path of a file readable only by the "
            "service account, holding one whsec_... line, e.g. /etc/llmd-supervisor/ci.whsec",
        )
    return value


def _address(key: str, value: object) -> str:
    if not isinstance(value, str) or not _ADDRESS.fullmatch(value):
        raise ConfigError(key, value, "use a plain address like oncall@example.org")
    return value


def _recipients(key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(
            key, value, 'a mail destination needs its recipients, e.g. ["oncall@example.org"]'
        )
    if len(value) > RECIPIENTS_MAX:
        raise ConfigError(key, len(value), f"list at most {RECIPIENTS_MAX} recipients")
    return tuple(_address(key, v) for v in value)


def shown_url(url: str) -> str:
    """`url` as it may be shown: scheme, host and port, the path and query elided (a
    Slack webhook's path is its credential)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError:
        return f"(a URL of {len(url)} characters, not shown)"
    if not parts.scheme or not host:
        return f"(a URL of {len(url)} characters, not shown)"
    shown_host = f"[{host}]" if ":" in host else host
    netloc = shown_host if port is None else f"{shown_host}:{port}"
    rest = "/..." if (parts.path not in ("", "/") or parts.query) else parts.path
    return f"{parts.scheme}://{netloc}{rest}"


def _proxy(value: object) -> str:
    """``[events] proxy``: an http:// or https:// URL of a host (and port), nothing else."""
    key = "events.proxy"
    example = 'an http:// or https:// URL such as "http://proxy.example.org:3128"'
    if not isinstance(value, str) or any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ConfigError(key, shown_proxy(value) if isinstance(value, str) else value, example)
    shown = shown_proxy(value)
    try:
        parts = urlsplit(value)
        _ = parts.port  # ValueError when it is not a port number
    except ValueError:
        raise ConfigError(key, shown, example) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, shown, example)
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(key, shown, f"no path, query or fragment: {example}")
    return value


def shown_proxy(url: str) -> str:
    """A proxy URL as it may be shown: scheme, host and port (never a user or password)."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return f"(a proxy URL of {len(url)} characters, not shown)"
    if not host:
        return f"(a proxy URL of {len(url)} characters, not shown)"
    shown_host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown_host}" + ("" if port is None else f":{port}")


def proxy_for(url: str, configured: str | None, environ: Mapping[str, str]) -> str | None:
    """The HTTP proxy a request to `url` goes through (None: directly): none when the
    host is in NO_PROXY (``no_proxy``); else `configured` (``[events] proxy``); else
    the environment's for the URL's scheme (``https_proxy``/``HTTPS_PROXY`` for https,
    ``http_proxy``/``HTTP_PROXY`` for http, then ``all_proxy``/``ALL_PROXY``; lower case
    first, as curl and Python's urllib read them). A proxy without a scheme is http://.

    NO_PROXY is a comma-separated list of: ``*`` (every host); a host name, which also
    covers its subdomains (``example.org`` and ``.example.org`` both cover
    ``hooks.example.org`` and ``example.org``); an IP address (IPv6 with or without
    brackets) or a CIDR network; each optionally with ``:port``, then only for that port."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = 0
    no_proxy = _env(environ, "no_proxy") or ""
    if any(_bypasses(entry, host, port) for entry in no_proxy.split(",")):
        return None
    chosen = configured or _env(environ, f"{parts.scheme}_proxy") or _env(environ, "all_proxy")
    if not chosen:
        return None
    return chosen if "://" in chosen else f"http://{chosen}"


def _env(environ: Mapping[str, str], name: str) -> str | None:
    """A proxy variable, the lower-case spelling first; blank is unset."""
    for spelled in (name, name.upper()):
        value = environ.get(spelled, "").strip()
        if value:
            return value
    return None


def _bypasses(entry: str, host: str, port: int) -> bool:
    """Whether one NO_PROXY entry covers `host` (lower case) on `port`."""
    entry = entry.strip().lower()
    if not entry:
        return False
    if entry == "*":
        return True
    name, wanted = entry, None
    if entry.startswith("["):  # [IPv6] or [IPv6]:port
        name, _, tail = entry[1:].partition("]")
        if tail.startswith(":") and tail[1:].isdigit():
            wanted = int(tail[1:])
    elif entry.count(":") == 1:  # name:port (more colons: a bare IPv6 address)
        name, _, port_text = entry.partition(":")
        if not port_text.isdigit():
            return False
        wanted = int(port_text)
    if wanted is not None and wanted != port:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        name = name.lstrip(".")
        return bool(name) and (host == name or host.endswith(f".{name}"))
    try:
        return address in ipaddress.ip_network(name, strict=False)
    except ValueError:
        return False
