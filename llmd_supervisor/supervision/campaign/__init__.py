"""Campaigns in the daemon: submit each point once, reuse verified points, share the room
among users, QOS back-off, cancel, their events and views; expansion off the loop.
May import: `core`, `adapters`, other supervision packages and `errors`; never `cli`.
"""
