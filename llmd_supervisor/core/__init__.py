"""The pure core: spec validation, rendering, Slurm output parsing, the verdict, the run
state machine and the run layout.

No I/O and no adapter or orchestration imports (tests/unit/test_layers.py checks it).
"""
