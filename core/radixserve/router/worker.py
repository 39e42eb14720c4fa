"""One worker as the router sees it: what it serves and can do (``WorkerFacts``, read
once at registration), how loaded it is (``WorkerLoad``, from its ``/get_load`` and the
router's own in-flight count), and whether it may get traffic (health checks and a
``CircuitBreaker``). All of it is soft state, rebuilt from traffic and probes."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Seconds for a worker's remembered peak throughput to fade by half (``PeakRate``).
CAPACITY_HALF_LIFE_S = 120.0
# A feature a request may need; a worker that does not report its features (a plain
# OpenAI server) is assumed to have them all.
FEATURES = ("generation", "embeddings", "structured_output", "tools", "logprobs", "n")


@dataclass(frozen=True)
class WorkerFacts:
    """What a worker serves: its model's name and identity, and what it can do."""

    model_id: str
    # The model's identity beyond its name (architecture, vocabulary size): two workers
    # with the same name and different identities are refused.
    identity: tuple[tuple[str, Any], ...] = ()
    device: str | None = None
    dtype: str | None = None
    backends: dict[str, str] = field(default_factory=dict)
    max_total_num_tokens: int | None = None
    features: dict[str, bool] = field(default_factory=dict)

    def supports(self, feature: str) -> bool:
        return self.features.get(feature, True)


@dataclass
class WorkerLoad:
    """Reported by the worker (summed over its replicas) at ``reported_at``."""

    num_reqs: int = 0
    num_waiting_reqs: int = 0
    num_tokens: int = 0  # tokens of its running and waiting requests (their whole contexts)
    num_waiting_tokens: int = 0  # tokens its queued requests have yet to prefill
    decode_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    reported_at: float = 0.0

    @classmethod
    def of(cls, entries: list[dict[str, Any]]) -> WorkerLoad:
        """From ``/get_load``: one entry per data-parallel replica (SGLang's shape)."""
        return cls(
            num_reqs=sum(int(e.get("num_reqs", 0)) for e in entries),
            num_waiting_reqs=sum(int(e.get("num_waiting_reqs", 0)) for e in entries),
            num_tokens=sum(int(e.get("num_tokens", 0)) for e in entries),
            num_waiting_tokens=sum(int(e.get("num_waiting_tokens", 0)) for e in entries),
            decode_tokens_per_s=_total(entries, "decode_tokens_per_s"),
            prefill_tokens_per_s=_total(entries, "prefill_tokens_per_s"),
            reported_at=time.monotonic(),
        )


def _total(entries: list[dict[str, Any]], key: str) -> float | None:
    rates = [e[key] for e in entries if e.get(key)]
    return sum(rates) if rates else None


@dataclass(frozen=True)
class Work:
    """A request's work on a worker, in tokens: prompt tokens to compute (those not
    cached there) and output tokens to generate."""

    prompt: int
    output: int


class PeakRate:
    """A measured rate's recent peak. The rate a worker reports follows the load it
    serves (one given little traffic decodes few tokens a second), so its capacity is
    the peak, fading by half every ``CAPACITY_HALF_LIFE_S`` so that a worker that slowed
    down is believed within minutes; None when not measured (yet, or since a restart)."""

    def __init__(self) -> None:
        self.value: float | None = None
        self._at = 0.0

    def observe(self, rate: float | None, at: float) -> None:
        if rate is None or self.value is None:
            self.value = rate
        else:
            self.value = max(rate, self.value * 0.5 ** ((at - self._at) / CAPACITY_HALF_LIFE_S))
        self._at = at


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Opens after ``failure_threshold`` consecutive failures; after ``open_seconds`` it is
    half-open and lets one request at a time try; ``success_threshold`` successes there
    close it, a failure opens it again."""

    def __init__(
        self,
        failure_threshold: int,
        success_threshold: int,
        open_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.failure_threshold, self.success_threshold, self.open_seconds = (
            failure_threshold,
            success_threshold,
            open_seconds,
        )
        self.clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self.clock() - self._opened_at >= self.open_seconds:
            self._state, self._successes, self._trial_in_flight = BreakerState.HALF_OPEN, 0, False
        return self._state

    def allows(self) -> bool:
        """Whether a request may be sent now (in half-open: when no trial is out)."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def on_send(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def on_success(self) -> None:
        self._trial_in_flight = False
        self._failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self._successes += 1
            if self._successes >= self.success_threshold:
                self._state = BreakerState.CLOSED

    def on_failure(self) -> None:
        self._trial_in_flight = False
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._state, self._opened_at = BreakerState.OPEN, self.clock()

    def reset(self) -> None:
        """A health check saw the worker serve again: give it traffic at once."""
        self._state, self._failures, self._trial_in_flight = BreakerState.CLOSED, 0, False


class Worker:
    """A worker URL with its facts, load, health and breaker."""

    def __init__(self, url: str, facts: WorkerFacts, breaker: CircuitBreaker):
        self.url, self.facts, self.breaker = url, facts, breaker
        self.healthy = True
        self.health_failures = 0
        self.health_successes = 0
        self.load = WorkerLoad()
        self.decode_capacity, self.prefill_capacity = PeakRate(), PeakRate()  # tokens/s
        self.in_flight = 0  # requests the router has sent here and not yet seen end
        self.in_flight_work = Work(0, 0)  # their uncached prompt and output tokens
        self.routed = 0

    @property
    def model_id(self) -> str:
        return self.facts.model_id

    def available(self) -> bool:
        return self.healthy and self.breaker.allows()

    def observe(self, load: WorkerLoad) -> None:
        self.load = load
        self.decode_capacity.observe(load.decode_tokens_per_s, load.reported_at)
        self.prefill_capacity.observe(load.prefill_tokens_per_s, load.reported_at)

    def forget_load(self) -> None:
        """Restarted: what was measured before says nothing now."""
        self.load, self.decode_capacity, self.prefill_capacity = WorkerLoad(), PeakRate(), PeakRate()

    def hold(self, work: Work, sign: int) -> None:
        """A request sent here (+1) or ended (-1)."""
        self.in_flight += sign
        held = self.in_flight_work
        self.in_flight_work = Work(held.prompt + sign * work.prompt, held.output + sign * work.output)

    def queued_work(self) -> Work:
        """Work not yet done here: the router's requests in flight, or, for the prompt
        tokens, what the worker reports queued when that is more (other routers' traffic)."""
        held = self.in_flight_work
        return Work(max(held.prompt, self.load.num_waiting_tokens), held.output)

    def queued_tokens(self) -> int:
        work = self.queued_work()
        return work.prompt + work.output

    def queued_requests(self) -> int:
        return max(self.load.num_reqs, self.in_flight)

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model_id": self.model_id,
            "healthy": self.healthy,
            "circuit_breaker": self.breaker.state.name.lower(),
            "device": self.facts.device,
            "dtype": self.facts.dtype,
            "backends": self.facts.backends,
            "max_total_num_tokens": self.facts.max_total_num_tokens,
            "features": {name: self.facts.supports(name) for name in FEATURES},
            "load": {
                "num_reqs": self.load.num_reqs,
                "num_waiting_reqs": self.load.num_waiting_reqs,
                "num_tokens": self.load.num_tokens,
                "num_waiting_tokens": self.load.num_waiting_tokens,
                "decode_tokens_per_s": self.load.decode_tokens_per_s,
                "prefill_tokens_per_s": self.load.prefill_tokens_per_s,
                "decode_capacity": self.decode_capacity.value,
                "prefill_capacity": self.prefill_capacity.value,
                "router_in_flight": self.in_flight,
                "router_in_flight_prompt_tokens": self.in_flight_work.prompt,
                "router_in_flight_output_tokens": self.in_flight_work.output,
            },
            "routed": self.routed,
        }
