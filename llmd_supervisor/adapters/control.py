"""The control socket transport, in three modules; this one re-exports their public names.

- `control_protocol`: the wire format, the table of ops (`OPS`), request decoding and
  reply encoding, error codes (pure);
- `control_server`: `ControlServer`, which serves a `Handler` on the Unix socket;
- `control_client`: `ControlClient`, and the reconnecting helpers waiting clients use.

Who may see which run is not the transport's business: that policy lives beside the API,
in `llmd_supervisor.supervision.access`.
"""

from __future__ import annotations

from llmd_supervisor.adapters.control_client import (
    ControlClient,
    Reconnect,
    call_retrying,
    connection_lost,
    resumable_stream,
)
from llmd_supervisor.adapters.control_protocol import (
    DEFAULT_MAX_MESSAGE,
    ERROR_CODES,
    OPS,
    PROTOCOL_VERSION,
    ArgSpec,
    Handler,
    OpSpec,
    Peer,
    Request,
    Send,
    decode_request,
)
from llmd_supervisor.adapters.control_server import ControlServer, peer_credentials
from llmd_supervisor.errors import ControlError

__all__ = [
    "DEFAULT_MAX_MESSAGE",
    "ERROR_CODES",
    "OPS",
    "PROTOCOL_VERSION",
    "ArgSpec",
    "ControlClient",
    "ControlError",
    "ControlServer",
    "Handler",
    "OpSpec",
    "Peer",
    "Reconnect",
    "Request",
    "Send",
    "call_retrying",
    "connection_lost",
    "decode_request",
    "peer_credentials",
    "resumable_stream",
]
