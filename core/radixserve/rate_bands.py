"""Batch-size bands: how a worker's step rates are split so that a router can predict
what a request will see there.

A worker's raw throughput rises with the batch it runs (a decode step of 32 requests
yields far more tokens a second than one of 1), so a rate averaged over all steps says
more about the load it was given than about its speed. The scheduler therefore keeps
one rate per band of batch size (``runtime/scheduling/stats.py``): prefill by the
prompt tokens a step computes, decode by the requests a step advances. ``/get_load``
and ``/server_info`` report them in the shape ``band_entries`` writes, and the router
(``router/worker.py``'s ``RateCurve``) reads them back with ``band_values``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

# Upper bounds (inclusive) of the bands; a last, open band holds what is above them.
PREFILL_BANDS: tuple[int, ...] = (64, 256, 1024, 4096)  # prompt tokens computed in one step
DECODE_BANDS: tuple[int, ...] = (1, 4, 16, 64)  # requests in one decode step


def band_index(bounds: Sequence[int], size: int) -> int:
    """The band of a batch of ``size``: the first whose upper bound is at least ``size``."""
    return bisect.bisect_left(bounds, size)


def band_entries(
    bounds: Sequence[int],
    rates: Sequence[float | None],
    sizes: Sequence[float | None],
    unit: str,
    outputs: Sequence[float | None] | None = None,
) -> list[dict[str, Any]]:
    """The report's shape: one entry per band, ``{"up_to": bound or None (open), "unit":
    what a step's size counts, "tokens_per_s": its steps' rate, "mean_size": their mean
    size}`` (both None while no step of that size was measured). The mean size places the
    rate within its band: a step's time at that size is ``mean_size / tokens_per_s``.

    ``outputs`` (decode): each band's ``output_tokens_per_s``, the tokens its steps gave
    their requests a second. It equals ``tokens_per_s`` (a token per request a step
    advances) but on a speculative worker, whose verify steps give a request the
    proposals they keep as well: a request's time per output token in a batch of
    ``mean_size`` is ``mean_size / output_tokens_per_s``."""
    uppers: list[int | None] = [*bounds, None]
    entries = [
        {"up_to": upper, "unit": unit, "tokens_per_s": rate, "mean_size": size}
        for upper, rate, size in zip(uppers, rates, sizes, strict=True)
    ]
    if outputs is not None:
        for entry, output in zip(entries, outputs, strict=True):
            entry["output_tokens_per_s"] = output
    return entries


def band_values(entries: Any, bounds: Sequence[int], key: str) -> tuple[float | None, ...]:
    """``key`` (``tokens_per_s``, ``mean_size`` or ``output_tokens_per_s``) of a report's entries, in band order; all
    None when the report has no bands, or bands of other bounds (another version of the worker)."""
    unknown = (None,) * (len(bounds) + 1)
    if not isinstance(entries, list) or [e.get("up_to") for e in entries if isinstance(e, dict)] != [*bounds, None]:
        return unknown
    values = [e.get(key) for e in entries]
    return tuple(float(v) if isinstance(v, int | float) and v > 0 else None for v in values)


def sum_rates(per_replica: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Data-parallel replicas' band rates (or mean sizes) added up band by band (None where
    none measured it): replicas stepping side by side at size m and rate r each are, for the
    worker as a whole, steps of 2m at 2r, each taking as long."""
    totals: list[float | None] = []
    for band in zip(*per_replica, strict=True):
        known = [rate for rate in band if rate is not None]
        totals.append(sum(known) if known else None)
    return totals
