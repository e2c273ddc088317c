"""The dashboard's pages and request rules (pure): typed views in, HTML text out. May import:
pure core; no I/O.
"""
