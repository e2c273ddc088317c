"""What Slurm's client commands print, parsed (pure): squeue/sacct/scontrol rows, batched
records with a bad row isolated to its job, and sacctmgr's submit limits. May import: `errors`
only; no I/O.
"""
