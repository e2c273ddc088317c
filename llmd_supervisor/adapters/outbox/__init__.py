"""Outbound events in the journal and their delivery: the outbox rows written with a run's
transition, the deliveries store, and the sender (httpx) that posts due deliveries.
May import: `core`, other adapters and `errors`; never `supervision` or `cli`.
"""
