"""The read-only web dashboard: a Starlette app over the control API, and its static files.
May import: `core`, `adapters`, other supervision packages and `errors`; never `cli`.
"""
