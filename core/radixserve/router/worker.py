"""One worker as the router sees it: what it serves and can do (``WorkerFacts``, read
at registration, its LoRA adapters kept up to date), how loaded it is (``WorkerLoad``,
from its ``/get_load`` and the router's own in-flight count), how fast it is at each batch
size (``RateCurve``s, from the same reports), and whether it may get traffic (health
checks and a ``CircuitBreaker``). All of it is soft state, rebuilt from traffic and probes."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.rate_bands import DECODE_BANDS, PREFILL_BANDS, band_values, sum_rates

# Seconds for a worker's remembered peak throughput to fade by half (``PeakRate``).
CAPACITY_HALF_LIFE_S = 120.0
# Seconds for the work routed to a worker to count half in its utilisation
# (``Worker.utilisation``): long enough to hold tens of requests per worker at the loads simulated, short
# enough to forget a burst within minutes.
UTILISATION_HALF_LIFE_S = 120.0
# A feature a request may need; a worker that does not report its features (a plain
# OpenAI server) is assumed to have them all.
FEATURES = ("generation", "embeddings", "structured_output", "tools", "logprobs", "n")


@dataclass(frozen=True)
class LoRAFacts:
    """A worker's multi-LoRA serving (``/server_info["worker"]["lora"]``): the adapters it
    holds, name -> path, and how many it may hold (None: no limit) and mix in one batch."""

    adapters: Mapping[str, str] = field(default_factory=dict)
    max_loaded: int | None = None
    max_per_batch: int | None = None

    @classmethod
    def of(cls, report: dict[str, Any] | None) -> LoRAFacts | None:
        """From the worker's report; None when LoRA is off there."""
        if report is None:
            return None
        adapters = dict(report.get("adapters") or {})
        return cls(adapters, report.get("max_loaded_loras"), report.get("max_loras_per_batch"))

    def has_room(self) -> bool:
        """Whether one more adapter may be loaded (``--max-loaded-loras``)."""
        return self.max_loaded is None or len(self.adapters) < self.max_loaded

    def describe(self) -> dict[str, Any]:
        return {
            "adapters": dict(self.adapters),
            "max_loaded_loras": self.max_loaded,
            "max_loras_per_batch": self.max_per_batch,
        }


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
    max_running_requests: int | None = None  # over all its replicas
    prefill_step_tokens: int | None = None  # the most prompt tokens one prefill step computes
    features: dict[str, bool] = field(default_factory=dict)
    disaggregation_mode: str = "null"  # prefill or decode: one half of a pair
    bootstrap_port: int | None = None  # a prefill worker's, as it reports it
    lora: LoRAFacts | None = None  # None: LoRA off (or a worker that does not say)
    speculative: str | None = None  # its speculative decoding algorithm; None: off (or a worker that does not say)

    def supports(self, feature: str) -> bool:
        return self.features.get(feature, True)

    def holds(self, adapter: str) -> bool:
        return self.lora is not None and adapter in self.lora.adapters


@dataclass
class WorkerLoad:
    """Reported by the worker (summed over its replicas) at ``reported_at``."""

    num_reqs: int = 0
    num_waiting_reqs: int = 0
    num_tokens: int = 0  # tokens of its running and waiting requests (their whole contexts)
    num_waiting_tokens: int = 0  # tokens its queued requests have yet to prefill
    decode_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    # per band of batch size (rate_bands.DECODE_BANDS / PREFILL_BANDS, then the open band), the rate
    # and the mean size of its steps, and for decode the tokens those steps gave their requests a
    # second (above the rate on a speculative worker); () when not reported
    decode_band_rates: tuple[float | None, ...] = ()
    decode_band_sizes: tuple[float | None, ...] = ()
    decode_band_output_rates: tuple[float | None, ...] = ()
    prefill_band_rates: tuple[float | None, ...] = ()
    prefill_band_sizes: tuple[float | None, ...] = ()
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
            decode_band_rates=_bands(entries, "decode_bands", DECODE_BANDS, "tokens_per_s"),
            decode_band_sizes=_bands(entries, "decode_bands", DECODE_BANDS, "mean_size"),
            decode_band_output_rates=_bands(entries, "decode_bands", DECODE_BANDS, "output_tokens_per_s"),
            prefill_band_rates=_bands(entries, "prefill_bands", PREFILL_BANDS, "tokens_per_s"),
            prefill_band_sizes=_bands(entries, "prefill_bands", PREFILL_BANDS, "mean_size"),
            reported_at=time.monotonic(),
        )


def _bands(entries: list[dict[str, Any]], name: str, bounds: Sequence[int], key: str) -> tuple[float | None, ...]:
    """The replicas' band values added up (``rate_bands.sum_rates``)."""
    return tuple(sum_rates([band_values(e.get(name), bounds, key) for e in entries]))


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


class RateCurve:
    """A worker's speed at one phase by step size: for each batch-size band, the last rate
    and mean step size it reported (a band is measured from the worker's steps of that
    size, so it does not grow with the traffic given, as a raw throughput would).

    Between the measured sizes a step's time is interpolated (made non-decreasing: a
    bigger step never takes less time), beyond the largest it grows at that size's rate,
    below the smallest it takes that size's rate. A worker that reports no bands has one
    rate for every size, its overall one."""

    def __init__(self, bounds: Sequence[int]):
        self.bounds = bounds
        self.rates: list[float | None] = [None] * (len(bounds) + 1)
        self.sizes: list[float | None] = [None] * (len(bounds) + 1)
        self.overall: float | None = None
        self._points: list[tuple[float, float]] = []  # (size, seconds a step of it takes), size ascending
        self._at: dict[int, float | None] = {}  # at()'s answers since the last report (asked per candidate)

    def observe(
        self, band_rates: Sequence[float | None], band_sizes: Sequence[float | None], overall: float | None
    ) -> None:
        band_sizes = band_sizes or (None,) * len(band_rates)  # an older report: rates alone
        for band, (rate, size) in enumerate(zip(band_rates, band_sizes, strict=True)):
            if rate is not None:
                self.rates[band], self.sizes[band] = rate, size or self._middle(band)
        self.overall = overall or self.overall
        points, slowest = [], 0.0
        for rate, size in zip(self.rates, self.sizes, strict=True):
            if rate is not None and size is not None:
                slowest = max(slowest, size / rate)
                points.append((size, slowest))
        self._points, self._at = points, {}

    def _middle(self, band: int) -> float:
        """Where a band's steps are assumed to lie when the report does not say."""
        low = self.bounds[band - 1] + 1 if band else 1
        return float((low + self.bounds[band]) / 2 if band < len(self.bounds) else 2 * low)

    def at(self, size: int) -> float | None:
        """The rate (tokens/s) of a step of ``size``; None when nothing is measured."""
        if size not in self._at:
            self._at[size] = self._interpolate(size)
        return self._at[size]

    def _interpolate(self, size: int) -> float | None:
        points = self._points
        if not points:
            return self.overall
        size = max(size, 1)
        first_size, first_s = points[0]
        if size <= first_size:
            return first_size / first_s
        for (low, low_s), (high, high_s) in zip(points, points[1:], strict=False):
            if size <= high:
                return size / (low_s + (high_s - low_s) * (size - low) / (high - low))
        last_size, last_s = points[-1]
        return last_size / last_s

    def describe(self) -> list[dict[str, Any]]:
        uppers = [*self.bounds, None]
        return [
            {"up_to": upper, "tokens_per_s": rate, "mean_size": size}
            for upper, rate, size in zip(uppers, self.rates, self.sizes, strict=True)
        ]


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

    def on_undecided(self) -> None:
        """A request ended without telling whether the worker is well (its client left, or
        another worker failed it): a half-open breaker may send its next trial."""
        self._trial_in_flight = False

    def on_failure(self) -> None:
        self._trial_in_flight = False
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._state, self._opened_at = BreakerState.OPEN, self.clock()

    def reset(self) -> None:
        """A health check saw the worker serve again: give it traffic at once."""
        self._state, self._failures, self._trial_in_flight = BreakerState.CLOSED, 0, False


class Worker:
    """A worker URL with its facts, load, rates, health and breaker."""

    def __init__(
        self, url: str, facts: WorkerFacts, breaker: CircuitBreaker, clock: Callable[[], float] = time.monotonic
    ):
        """``clock``: the time of ``WorkerLoad.reported_at`` (a simulator passes its own)."""
        self.url, self.facts, self.breaker, self.clock = url, facts, breaker, clock
        self.healthy = True
        self.health_failures = 0
        self.health_successes = 0
        self.load = WorkerLoad()
        self.decode_capacity, self.prefill_capacity = PeakRate(), PeakRate()  # tokens/s
        self.decode_curve, self.prefill_curve = RateCurve(DECODE_BANDS), RateCurve(PREFILL_BANDS)
        # The tokens a decode step of each size gives its requests a second (``output_curve.at(b)``:
        # a request in a batch of b gets a token every b / that seconds); not measured where the
        # worker does not report it, and then the decode curve's (a token per request a step).
        self.output_curve = RateCurve(DECODE_BANDS)
        self.in_flight = 0  # requests the router has sent here and not yet seen end
        self.in_flight_work = Work(0, 0)  # their uncached prompt and output tokens
        self.routed = 0
        # The uncached prompt tokens routed here lately, each request's fading by half every
        # UTILISATION_HALF_LIFE_S, as of _recent_at.
        self._recent_prompt = 0.0
        self._recent_at = clock()
        # Prompt tokens waiting for prefill: the last report's, plus what was sent since, at _backlog_at.
        self._backlog, self._backlog_at = 0.0, clock()
        # What the last report counted waiting beyond this router's requests in flight then
        # (other routers' traffic): with those in flight now, the most that can be waiting.
        self._others_waiting = 0.0
        # Counts the router's own changes to the facts (an adapter it loaded here), so that a
        # /server_info read sent before one does not undo it (``set_lora``).
        self.facts_revision = 0

    @property
    def model_id(self) -> str:
        return self.facts.model_id

    def available(self) -> bool:
        return self.healthy and self.breaker.allows()

    def set_lora(self, lora: LoRAFacts | None, revision: int | None = None) -> bool:
        """Its LoRA facts as read from the worker when ``revision`` (``facts_revision``
        when the read was sent) is given, else as the router changed them; False (and
        nothing changes) when the router changed them after the read was sent."""
        if revision is not None and revision != self.facts_revision:
            return False
        if revision is None:
            self.facts_revision += 1
        self.facts = replace(self.facts, lora=lora)
        return True

    def observe(self, load: WorkerLoad) -> None:
        self.load = load
        self.decode_capacity.observe(load.decode_tokens_per_s, load.reported_at)
        self.prefill_capacity.observe(load.prefill_tokens_per_s, load.reported_at)
        self.decode_curve.observe(load.decode_band_rates, load.decode_band_sizes, load.decode_tokens_per_s)
        if load.decode_band_output_rates:
            self.output_curve.observe(load.decode_band_output_rates, load.decode_band_sizes, None)
        self.prefill_curve.observe(load.prefill_band_rates, load.prefill_band_sizes, load.prefill_tokens_per_s)
        self._backlog, self._backlog_at = float(load.num_waiting_tokens), load.reported_at
        self._others_waiting = max(0.0, load.num_waiting_tokens - self.in_flight_work.prompt)

    def forget_load(self) -> None:
        """Restarted: what was measured before says nothing now."""
        self.load, self.decode_capacity, self.prefill_capacity = WorkerLoad(), PeakRate(), PeakRate()
        self.decode_curve, self.prefill_curve = RateCurve(DECODE_BANDS), RateCurve(PREFILL_BANDS)
        self.output_curve = RateCurve(DECODE_BANDS)
        self._backlog, self._backlog_at = 0.0, self.clock()
        self._others_waiting = 0.0

    def hold(self, work: Work, sign: int) -> None:
        """A request sent here (+1) or ended (-1)."""
        waiting = self.queued_prefill() + max(sign, 0) * work.prompt
        self.in_flight += sign
        held = self.in_flight_work
        self.in_flight_work = Work(held.prompt + sign * work.prompt, held.output + sign * work.output)
        # Ended, its prompt is waiting no longer (see queued_prefill's bound).
        self._backlog = min(waiting, self.in_flight_work.prompt + self._others_waiting)
        self._backlog_at = self.clock()
        if sign > 0:
            self._recent_prompt = self._recent_prompt * self._fade() + work.prompt

    def _fade(self) -> float:
        """What the recent work counts now of what it counted at ``_recent_at`` (which becomes now)."""
        now = self.clock()
        fade: float = 0.5 ** ((now - self._recent_at) / UTILISATION_HALF_LIFE_S)
        self._recent_at = now
        return fade

    def utilisation(self) -> float:
        """The share of its time the prompts routed here lately keep the worker busy:
        their uncached tokens at the rate of a full prefill step, an exponentially fading
        sum over a mean life of ``UTILISATION_HALF_LIFE_S / ln 2`` seconds, so the load
        given in the last minutes counts, not just the queue now. Prefill alone: it is
        what a request's first token waits for (a prefill step goes before decode steps),
        and its rate is measured at every load, while a decode rate is known only for the
        batches the worker has run (a lightly used worker's would make its decode work
        look several times dearer). 0 while the worker has measured no prefill rate."""
        prefill = self.prefill_curve.at(self.prefill_step_tokens(1 << 20))
        if not prefill:
            return 0.0
        self._recent_prompt *= self._fade()
        return self._recent_prompt / prefill * math.log(2) / UTILISATION_HALF_LIFE_S

    def prefill_step_tokens(self, tokens: int) -> int:
        """The prompt tokens of the prefill step that ``tokens`` queued ones make here."""
        step = self.facts.prefill_step_tokens
        return max(1, min(tokens, step) if step else tokens)

    def queued_prefill(self) -> float:
        """Prompt tokens not yet prefilled here, now: the last report's waiting tokens plus
        the prompts sent since, less what the worker has computed since at its prefill
        rate; never more than the router's own requests in flight and what the last report
        counted beyond them (a request that ended is not waiting, though the report that
        counted it is still the newest; a worker that does not report load has only the
        router's own requests)."""
        backlog = self._backlog
        rate = self.prefill_curve.at(self.prefill_step_tokens(int(backlog)))
        if rate is not None:
            backlog = max(0.0, backlog - (self.clock() - self._backlog_at) * rate)
        return min(backlog, self.in_flight_work.prompt + self._others_waiting)

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
            "max_running_requests": self.facts.max_running_requests,
            "prefill_step_tokens": self.facts.prefill_step_tokens,
            "features": {name: self.facts.supports(name) for name in FEATURES},
            "lora": self.facts.lora.describe() if self.facts.lora is not None else None,
            "speculative": self.facts.speculative,
            "load": {
                "num_reqs": self.load.num_reqs,
                "num_waiting_reqs": self.load.num_waiting_reqs,
                "num_tokens": self.load.num_tokens,
                "num_waiting_tokens": self.load.num_waiting_tokens,
                "decode_tokens_per_s": self.load.decode_tokens_per_s,
                "prefill_tokens_per_s": self.load.prefill_tokens_per_s,
                "decode_capacity": self.decode_capacity.value,
                "prefill_capacity": self.prefill_capacity.value,
                "decode_bands": self.decode_curve.describe(),
                "decode_output_bands": self.output_curve.describe(),
                "prefill_bands": self.prefill_curve.describe(),
                "queued_prefill_tokens": round(self.queued_prefill()),
                "router_in_flight": self.in_flight,
                "router_in_flight_prompt_tokens": self.in_flight_work.prompt,
                "router_in_flight_output_tokens": self.in_flight_work.output,
            },
            "routed": self.routed,
        }
