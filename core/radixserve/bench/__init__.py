"""``radixserve bench``: offline (the Engine in-process) and serving (any
OpenAI-compatible server over HTTP) benchmarks on seeded, reproducible request
sets. Modules, top down: ``cli`` (flags, dispatch), ``offline`` and
``serving`` (runners), ``driver`` (arrivals and concurrency), ``datasets``,
``metrics`` (summary, report, JSON), ``memory`` (peak RSS), ``plot``."""

from radixserve.bench.datasets import BenchRequest
from radixserve.bench.metrics import RequestResult, summarize

__all__ = ["BenchRequest", "RequestResult", "summarize"]
