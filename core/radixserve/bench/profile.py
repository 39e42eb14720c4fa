"""Numbers from a scheduler profile (the Chrome trace ``start_profile`` writes):
how long a decode step of one batch size takes, and how busy the device is
meanwhile.

Each scheduler step's launch is a host annotation ``radixserve.<kind>[...]``
(cat ``user_annotation``). With overlap scheduling and device graphs a step's
kernels run after its annotation ends, so neither is measured per annotation:

- a step's wall time is from its annotation's start to the next step's start
  (the median over the selected decode steps that another step follows);
- the device-busy fraction is the union of device intervals (cat ``kernel``,
  ``gpu_memcpy``, ``gpu_memset``), clipped to the window from the first to the
  last selected step's start, divided by that window's length.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

STEP_PREFIX = "radixserve."
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})

Interval = tuple[float, float]  # start, end (microseconds, as in the trace)


@dataclass(frozen=True)
class DecodeProfile:
    """Decode steps of one batch size in a trace (times in milliseconds)."""

    steps: int  # selected decode steps
    step_ms_median: float  # start to the next step's start
    host_ms_median: float  # the annotation itself: building the batch and launching it
    window_ms: float  # first to last selected step's start
    device_busy_fraction: float | None  # None: the trace holds no device activity at all


def step_annotations(trace: dict[str, Any]) -> list[tuple[str, Interval]]:
    """Every scheduler step in the trace, in time order: (name, (start, end))."""
    steps = [
        (e["name"], (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(STEP_PREFIX)
    ]
    return sorted(steps, key=lambda s: s[1][0])


def device_intervals(trace: dict[str, Any]) -> list[Interval]:
    return [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]


def busy_time(intervals: list[Interval], window: Interval) -> float:
    """Length of the union of ``intervals`` inside ``window``."""
    lo, hi = window
    total, end = 0.0, lo
    for start, stop in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        start = max(start, end)  # what the intervals before it covered is counted
        if stop > start:
            total += stop - start
            end = stop
    return total


def decode_profile(trace: dict[str, Any], batch_size: int) -> DecodeProfile | None:
    """The decode steps of ``batch_size`` in ``trace``; None with fewer than two of them."""
    name = f"{STEP_PREFIX}decode[bs={batch_size}]"
    steps = step_annotations(trace)
    picked = [i for i, (n, _) in enumerate(steps) if n == name]
    if len(picked) < 2:
        return None
    periods = [steps[i + 1][1][0] - steps[i][1][0] for i in picked if i + 1 < len(steps)]
    window = (steps[picked[0]][1][0], steps[picked[-1]][1][0])
    devices = device_intervals(trace)
    busy = busy_time(devices, window) / (window[1] - window[0]) if devices and window[1] > window[0] else None
    return DecodeProfile(
        steps=len(picked),
        step_ms_median=statistics.median(periods) / 1000,
        host_ms_median=statistics.median(steps[i][1][1] - steps[i][1][0] for i in picked) / 1000,
        window_ms=(window[1] - window[0]) / 1000,
        device_busy_fraction=busy,
    )
