"""The control API: what each op does, the access rule, what a run's status and list show,
and following a run's log copies.
May import: `core`, `adapters`, other supervision packages and `errors`; never `cli`.
"""
