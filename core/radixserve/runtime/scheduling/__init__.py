"""Scheduling: what runs next. The scheduler composed of its parts (the prefill
planner, the KV ledger, the intake queue, the outbox), the scheduling policy,
stop checks and the statistics it reports."""
