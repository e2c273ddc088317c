"""Outbound events (DESIGN.md section 13, pure): the events as data, what a transition
makes (the outbox), the facts they report, routing to destinations, delivery back-off,
Slack and mail texts, and Standard Webhooks signatures. May import: pure core; no I/O.
"""
