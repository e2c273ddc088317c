"""The control API: the typed runs service (`service.RunsService`: what each run op does
and the access rule), the op table that decodes requests into it, what a run's status and
list show, and following a run's log copies.
May import: `core`, `adapters`, other supervision packages and `errors`; never `cli`.
"""
