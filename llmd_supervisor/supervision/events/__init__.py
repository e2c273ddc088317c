"""The control socket's `events_*` ops over the outbox's deliveries.
May import: `core`, `adapters`, other supervision packages and `errors`; never `cli`.
"""
