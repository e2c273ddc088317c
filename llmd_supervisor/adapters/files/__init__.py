"""Local files of finished runs: the archive writer and benchmark result files parsed in a
bounded child process.
May import: `core`, other adapters and `errors`; never `supervision` or `cli`.
"""
