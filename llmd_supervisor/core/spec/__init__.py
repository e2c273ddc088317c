"""Run specs: the TOML a user submits, decoded and validated into frozen dataclasses (pure).

Owns the `[run]`, `[topology]`, `[benchmark]`, `[container]`, `[slurm]`, `[recipe]`, router
and sidecar tables, the foreign kinds of job (a user's own script, an adopted job), where a
run's log directory may be, and which file a user handed us. May import: `llmd_supervisor.errors`
and other pure core packages; never anyio, asyncssh, sqlite3 or I/O.
"""
