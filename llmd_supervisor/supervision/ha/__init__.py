"""Leadership in the daemon: the lease keeper (driver of `core.ha.lease`) and which clusters
this daemon acts for, with the tasks that act for them.
May import: `core`, `adapters`, other supervision packages and `errors`; never `cli`.
"""
