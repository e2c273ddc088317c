"""One object per configured cluster (Slurm client, poller, how its files are reached) and
the poller, the only place the daemon asks Slurm about its jobs.
May import: `core`, `adapters`, other supervision packages and `errors`; never `cli`.
"""
