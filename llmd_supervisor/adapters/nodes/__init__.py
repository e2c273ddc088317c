"""A job's nodes and files: SSH links (one multiplexed connection per node), byte-exact log
tailing, and reading a job's files through `node/safe_read.py`.
May import: `core`, other adapters and `errors`; never `supervision` or `cli`.
"""
