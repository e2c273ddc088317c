"""The verdict (DESIGN.md section 5, pure): what a finished job's evidence proves, why a run
that did not succeed failed (the cause), the completion marker, and what an attempt cost.
May import: other pure core packages; no I/O.
"""
