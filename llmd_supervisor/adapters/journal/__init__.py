"""The run journal (SQLite by default, or a shared PostgreSQL): the stores, rows, schema and
migrations, group commit, the writer a fenced transaction states, campaigns' tables and the
leadership lease's statements. Owns the database; turns its errors into ours.
May import: `core`, other adapters and `errors`; never `supervision` or `cli`.
"""
