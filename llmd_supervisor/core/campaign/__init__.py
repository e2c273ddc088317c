"""Campaigns (DESIGN.md section 12, pure): a campaign file and its bounded expansion into
jobs, campaigns over a user's own script, admission (caps, canaries, fair room per user),
whether a verified point may be reused, a campaign's life, and its control-socket answers.
May import: pure core; no I/O.
"""
