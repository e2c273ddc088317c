"""One run's life (pure): the state machine (`step`), the kind of run (`kinds`: a rendered
spec, a user's own script, an adopted job), retry and quarantine policy, node
health decisions, every name and path of a run, and job text made safe. May import: pure
core; no I/O.
"""
