"""Prometheus metrics of one server, in its own CollectorRegistry (several
servers in one process, e.g. tests, do not clash).

Gauges mirror the scheduler's stats and are refreshed when /metrics is scraped,
except ``cache_hit_rate``, computed from this server's own token counters so
that it covers exactly the requests they count (warm-ups excluded). Counters
and histograms are fed by the TokenizerManager from every output of every
request until the scheduler finishes it, its client gone or not (so aborted
and disconnected requests' tokens count), and by the access log, which counts
error statuses.

With --dp-size > 1 the ``replica_*`` families carry a ``dp_rank`` label, one
series per replica, read from ``server_info``'s ``replicas`` at scrape time
(``ReplicaCollector``): whether it is up, its running and queued requests, KV
use, the requests the controller dispatched to it and the tokens it made.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "radixserve:"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_QUEUE_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# Scheduler stat -> help text; each becomes a gauge of the same name.
_GAUGES = {
    "num_running_reqs": "requests being decoded or prefilled",
    "num_queue_reqs": "requests waiting to be scheduled",
    "token_usage": "fraction of the KV pool in use (evictable cache excluded)",
    "cache_hit_rate": "prompt tokens served from the prefix cache / prompt tokens (of the counted requests)",
    "num_retracted_reqs": "requests retracted to free KV memory since start",
}


# Per-replica families: name -> (help, the replica's value, counter?).
_REPLICA_FAMILIES: dict[str, tuple[str, Any, bool]] = {
    "replica_up": ("1 while the data-parallel replica serves, 0 once it died", lambda r: int(r["alive"]), False),
    "replica_num_running_reqs": ("the replica's running requests", lambda r: r["stats"]["num_running_reqs"], False),
    "replica_num_queue_reqs": ("the replica's waiting requests", lambda r: r["stats"]["num_queue_reqs"], False),
    "replica_token_usage": ("fraction of the replica's KV pool in use", lambda r: r["stats"]["token_usage"], False),
    "replica_requests_dispatched": (
        "requests the data-parallel controller sent to the replica",
        lambda r: r["requests_dispatched_total"],
        True,
    ),
    "replica_generation_tokens": (
        "tokens the replica generated",
        lambda r: r["stats"]["generation_tokens_total"],
        True,
    ),
}


class ReplicaCollector(Collector):
    """The ``replica_*`` families of the last ``server_info`` (none without data parallelism)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.replicas: list[dict[str, Any]] = []

    def collect(self) -> Iterator[Metric]:
        if not self.replicas:
            return
        for name, (doc, value, is_counter) in _REPLICA_FAMILIES.items():
            family_type = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = family_type(PREFIX + name, doc, labels=("model_name", "dp_rank"))
            for replica in self.replicas:
                if replica["stats"] is not None or name == "replica_up":  # a dead replica has no stats
                    family.add_metric((self.model_name, str(replica["dp_rank"])), value(replica))
            yield family


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ("model_name",)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def labelled_counter(name: str, doc: str, label: str) -> Counter:
            return Counter(PREFIX + name, doc, (*labels, label), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.gauges = {name: gauge(name, doc) for name, doc in _GAUGES.items()}
        self.replicas = ReplicaCollector(model_name)
        self.registry.register(self.replicas)
        self.model_name = model_name
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "generated tokens, aborted requests' included")
        self.cached_tokens = counter("cached_tokens", "prompt tokens served from the prefix cache")
        self.num_requests = labelled_counter(
            "num_requests",
            "scheduler requests (one per choice) by finish reason: stop, length or abort "
            "(refused and disconnected included)",
            "finish_reason",
        )
        self.num_request_errors = labelled_counter(
            "num_request_errors", "HTTP requests answered with an error, by status (499: the client left first)", "code"
        )
        for reason in ("stop", "length", "abort"):  # present from the start, at 0
            self.num_requests.labels(model_name, reason)
        self.queue_time = histogram("queue_time_seconds", "time from arrival to first admission", _QUEUE_BUCKETS)
        self._prompt_total = 0
        self._cached_total = 0
        self.time_to_first_token = histogram("time_to_first_token_seconds", "time to first token", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "time between output tokens", _LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "request latency, arrival to finish", _E2E_BUCKETS
        )

    # ---- TokenizerManager hooks -----------------------------------------------------
    def record_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def record_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def record_admitted(self, queue_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A request was first scheduled (where the scheduler counts its prompt)."""
        self.queue_time.observe(queue_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens

    def record_generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)

    def record_finish(self, e2e_s: float, finish_reason: str) -> None:
        self.e2e_request_latency.observe(e2e_s)
        self.num_requests.labels(self.model_name, finish_reason).inc()

    # ---- access log hook ------------------------------------------------------------
    def record_error(self, status: int) -> None:
        self.num_request_errors.labels(self.model_name, str(status)).inc()

    # ---- scrape ---------------------------------------------------------------------
    def update(self, info: dict[str, Any]) -> None:
        """Refresh the gauges from ``control("server_info")``: its ``stats`` (the
        replicas' totals with data parallelism) and its ``replicas``, if any."""
        stats = info["stats"]
        self.replicas.replicas = info.get("replicas", [])
        for name, gauge in self.gauges.items():
            if name != "cache_hit_rate":
                gauge.set(stats[name])
        self.gauges["cache_hit_rate"].set(self.cache_hit_rate)

    @property
    def cache_hit_rate(self) -> float:
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
