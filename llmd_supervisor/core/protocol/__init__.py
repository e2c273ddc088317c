"""What crosses the control socket for runs: the typed results and stream items of each op
(pure). Campaign answers live in `core.campaign.views`. May import: pure core; no I/O.
"""
