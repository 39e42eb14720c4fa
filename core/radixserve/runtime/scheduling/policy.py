"""Waiting-queue order: fcfs, lpm (longest cached prefix first) and priority."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.runtime.execution.request import Req

# Matching every waiting prompt against the tree costs time; past this many
# waiting requests lpm falls back to arrival order (as SGLang does).
LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, prefix_len: Callable[[Req], int]) -> list[Req]:
    if policy == "fcfs" or (policy == "lpm" and len(waiting) > LPM_MAX_QUEUE):
        return sorted(waiting, key=lambda r: r.arrival)
    if policy == "lpm":
        return sorted(waiting, key=lambda r: (-prefix_len(r), r.arrival))
    if policy == "priority":
        return sorted(waiting, key=lambda r: (-r.priority, r.arrival))
    raise ValueError(f"schedule_policy: unknown policy {policy!r}")
