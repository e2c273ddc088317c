"""Benchmark results as evidence (pure): parse, gate, tabulate; the values a results table's
rows are read as, what a result file says of its deployment, the GPUs throughputs are
divided by, and the report's chart models and HTML pieces. May import: pure core; no I/O.
"""
