"""HTTP serving for the daemon (uvicorn on sockets the daemon bound, with per-listener and
per-peer caps and a head timeout) and charts drawn as SVG.
May import: `core`, other adapters and `errors`; never `supervision` or `cli`.
"""
