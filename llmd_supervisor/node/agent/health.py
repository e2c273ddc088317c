"""Health probes of engines, sidecars and router processes, and this node's address."""

from __future__ import annotations

import socket
from http.client import HTTPConnection
from typing import Tuple

from .config import ConfigError


def check_health(host: str, port: int, path: str, connect_s: float, read_s: float) -> str:
    """Return "" when ``GET path`` answers 200, else a short reason. Never blocks longer
    than ``connect_s + read_s`` (a listener that accepts but never answers hits
    ``read_s``)."""
    conn = HTTPConnection(host, port, timeout=connect_s)
    try:
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(read_s)
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        resp.read(4096)
        if resp.status == 200:
            return ""
        return "HTTP %d" % resp.status
    except socket.timeout:
        return "timed out"
    except OSError as exc:
        return exc.strerror or exc.__class__.__name__
    except Exception as exc:  # http.client raises a zoo of protocol errors
        return exc.__class__.__name__
    finally:
        conn.close()


def check_tcp(host: str, port: int, timeout_s: float) -> str:
    """ "" when `host:port` accepts a TCP connection, else a short reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except socket.timeout:
        return "timed out"
    except OSError as exc:
        return exc.strerror or exc.__class__.__name__


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(ip: str) -> str:
    """The local interface that holds the IPv4 address `ip`, or "" (stdlib ioctl)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(got[20:24]) == ip:
                return name
    return ""


def node_address(node_name: str) -> Tuple[str, str]:
    """This node's IPv4 address and the interface holding it, as InferenceX finds them
    (`ip route get 1.1.1.1`): the source address of the default route, found with a UDP
    connect (no packet is sent); without a default route, the address `node_name`
    resolves to when it is one of this node's own. Raises ConfigError otherwise."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("1.1.1.1", 80))
            ip = str(s.getsockname()[0])
        except OSError:
            ip = ""
    if ip and interface_of(ip):
        return ip, interface_of(ip)
    try:
        ip = socket.gethostbyname(node_name)
    except OSError as exc:
        raise ConfigError(
            "cannot find this node's IPv4 address: no default route, and %r does not"
            " resolve (%s)" % (node_name, exc)
        ) from None
    iface = interface_of(ip)
    if not iface:
        raise ConfigError(
            "cannot find this node's IPv4 address: no default route, and %r resolves to"
            " %s, which no interface here holds" % (node_name, ip)
        )
    return ip, iface
