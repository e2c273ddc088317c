"""Several daemons on one journal (pure): the leadership lease as data and the fencing rule
every shared-journal write obeys. May import: pure core; no I/O.
"""
