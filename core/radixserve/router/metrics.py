"""The router's Prometheus metrics, in its own CollectorRegistry, all under
``radixserve_router:``. Per worker (label ``worker``, its URL): requests by route and
status, errors by kind, retries, latency and time to first byte, estimated prompt
tokens routed, health and circuit-breaker state, requests in flight, LoRA adapters loaded
(``outcome``: loaded, failed). For the router: requests refused by admission (``reason``:
queue_full, queue_timeout) and the queue depth."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from radixserve.router.worker import Worker

PREFIX = "radixserve_router:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class WorkerSeries:
    """One worker's series that every forwarded request updates, looked up once (a
    labelled metric's lookup takes a lock and builds its key each time)."""

    in_flight: Any
    latency: Any
    first_byte: Any
    routed_tokens: Any
    requests: Counter
    url: str
    _requests: dict[tuple[str, int], Any] = field(default_factory=dict)

    def answered(self, route: str, status: int) -> Any:
        """The requests counter of ``route`` answered with ``status``."""
        key = (route, status)
        if key not in self._requests:
            self._requests[key] = self.requests.labels(self.url, route, str(status))
        return self._requests[key]


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "requests answered, by worker, route and status",
            ["worker", "route", "status"],
            registry=r,
        )
        self.errors = Counter(
            PREFIX + "worker_errors",
            "failed tries on a worker: connect (no connection or no answer), status (a retryable status), "
            "stream (the answer broke off after it began)",
            ["worker", "kind"],
            registry=r,
        )
        self.retries = Counter(PREFIX + "retries", "tries moved off a worker to another", ["worker"], registry=r)
        self.latency = Histogram(
            PREFIX + "request_latency_seconds",
            "request latency through the router",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_byte = Histogram(
            PREFIX + "time_to_first_byte_seconds",
            "time from the request's arrival to the first byte of the worker's answer",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.routed_tokens = Counter(
            PREFIX + "routed_prompt_tokens", "prompt tokens routed (estimated from characters)", ["worker"], registry=r
        )
        self.healthy = Gauge(
            PREFIX + "worker_healthy", "1 while the worker passes its health checks", ["worker"], registry=r
        )
        self.breaker = Gauge(PREFIX + "circuit_breaker_state", "0 closed, 1 half-open, 2 open", ["worker"], registry=r)
        self.in_flight = Gauge(PREFIX + "worker_in_flight", "requests forwarded and not ended", ["worker"], registry=r)
        self.adapter_loads = Counter(
            PREFIX + "adapter_loads",
            "LoRA adapters the router had a worker load, a request naming one that no candidate held, by outcome",
            ["worker", "outcome"],
            registry=r,
        )
        self.refused = Counter(PREFIX + "admission_refused", "requests refused by admission", ["reason"], registry=r)
        self.queue_depth = Gauge(PREFIX + "admission_queue_depth", "requests waiting for admission", registry=r)
        self._series: dict[str, WorkerSeries] = {}

    def of(self, url: str) -> WorkerSeries:
        """The per-request series of the worker at ``url``."""
        series = self._series.get(url)
        if series is None:
            series = self._series[url] = WorkerSeries(
                in_flight=self.in_flight.labels(url),
                latency=self.latency.labels(url),
                first_byte=self.first_byte.labels(url),
                routed_tokens=self.routed_tokens.labels(url),
                requests=self.requests,
                url=url,
            )
        return series

    def worker_joined(self, worker: Worker) -> None:
        self.worker_state(worker)
        self.in_flight.labels(worker.url).set(0)

    def worker_state(self, worker: Worker) -> None:
        self.healthy.labels(worker.url).set(1 if worker.healthy else 0)
        self.breaker.labels(worker.url).set(int(worker.breaker.state))

    def worker_left(self, worker: Worker) -> None:
        for gauge in (self.healthy, self.breaker, self.in_flight):
            gauge.remove(worker.url)
        self._series.pop(worker.url, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
