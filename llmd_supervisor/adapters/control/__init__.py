"""The control socket: wire protocol and op table, server (peer credentials, limits and
timeouts), client, and what its peers hold against the limits.
May import: `core`, other adapters and `errors`; never `supervision` or `cli`.
"""
