"""``radixserve bench``: offline (the Engine in-process) and serving (any
OpenAI-compatible server over HTTP) benchmarks on seeded, reproducible request
sets. Modules, top down: ``args`` (flags), ``cli`` (dispatch), ``offline`` and
``serving`` (runners), ``driver`` (arrivals and concurrency), ``datasets``,
``metrics`` (summary, report, JSON), ``memory`` (peak RSS), ``plot``.

The names below load on first use: ``radixserve`` builds its parser (``args``)
for every command, and ``datasets`` imports numpy and transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.bench.datasets import BenchRequest
    from radixserve.bench.metrics import RequestResult, summarize

__all__ = ["BenchRequest", "RequestResult", "summarize"]

_HOMES = {
    "BenchRequest": "radixserve.bench.datasets",
    "RequestResult": "radixserve.bench.metrics",
    "summarize": "radixserve.bench.metrics",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
