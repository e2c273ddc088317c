"""The journal's configuration and schema decisions (pure): which backend and how to reach
it (`[journal]`), and which migrations a journal needs. May import: `errors`; no I/O.
"""
