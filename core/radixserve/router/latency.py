"""The time to first token a request would see on a worker, and the delay it would
cause there, predicted from what the router knows of it (``latency_aware``'s score),
and the log of the last decisions made by it (``GET /debug/decisions``).

The prediction follows how a radixserve scheduler runs a request (a prefill step is
launched whenever one can be formed, else a decode step; a request is admitted only
while the running batch has a free slot):

- prefill: the prompt tokens queued ahead of it (``Worker.queued_prefill``) and its own
  uncached ones, at the worker's prefill rate for the step they make (a chunk at most);
- decode wait: the decode step in progress when it arrives, at the decode rate of the
  batch running there; and when every slot is taken (``--max-running-requests``), the
  output tokens of the requests ahead of it beyond the slots, at the decode rate of a
  full batch, until enough of them finish;
- imposed: on a worker with requests running, the request's uncached tokens hold them
  up for as long as they take to compute (a prefill step goes before their next decode
  step), so they count twice there. The score is then the delay the placement causes,
  not only the one the request sees: a busy fleet keeps a prefix group whole rather than
  prefilling its prefix again on another busy worker (that compute delays everyone there,
  and on hardware the workers share, everyone), while an idle worker still takes it
  over as soon as waiting costs more than prefilling the prompt there;
- queueing: what the worker's recent utilisation (``Worker.utilisation``: the prompt
  work routed to it over the last minutes) makes a request wait on average
  (``expected_queueing``): the queue snapshot forgets the load a worker was given a
  moment ago, this term does not, and it is what evens out the shares in the long run.

Rates are the worker's own per batch-size band (``Worker.prefill_curve``,
``decode_curve``); a worker that has measured none yet is given the median of the
candidates that have, so that it gets its share of traffic and is measured.

Each candidate's time per output token (``tpot_s``) is predicted too: the batch the request
would join, over the tokens a decode step of that size gives its requests a second
(``Worker.output_curve``: more than one a request on a speculative worker, whose verify
steps keep proposals). A request that states latency objectives (``LatencyObjective``:
the ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` headers) goes to a candidate predicted to
meet them; that is how latency-bound requests find the speculative workers of a fleet
while they have the headroom, and other requests are placed as before.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from radixserve.router.worker import RateCurve, Worker

# Rates assumed while no candidate has measured a phase (tokens/s). Only their ratio
# matters then: a prompt token is computed with many others in a step, an output
# token takes a step of its own.
UNMEASURED_PREFILL_TOKENS_PER_S = 1000.0
UNMEASURED_DECODE_TOKENS_PER_S = 50.0
# The most utilisation ``expected_queueing`` believes (its wait is unbounded at 1).
UTILISATION_CAP = 0.95


@dataclass(slots=True)
class ScoreTerms:
    """One candidate's predicted TTFT for a request, term by term (tokens, tokens/s, seconds)."""

    worker: str
    queued_prefill_tokens: int  # ahead of the request
    own_prefill_tokens: int  # the request's prompt tokens not cached there
    cached_tokens: int  # the request's prompt tokens the prefix tree credits the worker with
    prefill_step_tokens: int  # the prefill step they make: the band whose rate is used
    prefill_tokens_per_s: float
    running_requests: int  # the worker's unfinished requests when the request arrives
    decode_batch: int  # the decode batch running there, whose rate is used
    decode_tokens_per_s: float
    requests_beyond_slots: int  # ahead of it when every running slot is taken (they must finish first)
    measured: bool  # False: the worker's rates are the other candidates' median
    utilisation: float  # of the worker's time, by the work routed to it lately (Worker.utilisation)
    prefill_s: float
    decode_wait_s: float
    queueing_s: float  # the wait its utilisation adds (expected_queueing)
    imposed_s: float  # what computing its uncached tokens holds up the requests running there
    total_s: float
    ttft_s: float  # what the request would wait for its first token: prefill, decode wait, queueing
    output_tokens_per_s: float  # what a decode step of the batch it joins gives its requests
    tpot_s: float  # then its time per output token


@dataclass(frozen=True)
class LatencyObjective:
    """A request's latency objectives, in seconds (None: not stated): its time to first
    token and its time per output token (the ``x-slo-ttft-ms`` and ``x-slo-tpot-ms``
    headers, as llm-d's endpoint picker reads them)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def excess(self, terms: ScoreTerms) -> float:
        """The largest ratio of a prediction to its objective: at most 1 where all are met."""
        ratios = [terms.ttft_s / self.ttft_s] if self.ttft_s else []
        if self.tpot_s:
            ratios.append(terms.tpot_s / self.tpot_s)
        return max(ratios, default=0.0)


class RateLookup:
    """The rates ``predict`` uses for one decision's candidates: each worker's own, or,
    where it measured nothing, the median of the candidates that did (computed once per
    batch size, only when needed)."""

    def __init__(self, candidates: Sequence[Worker]):
        self.candidates = candidates
        self._medians: dict[tuple[str, int], float] = {}

    def prefill(self, worker: Worker, tokens: int) -> tuple[float, bool]:
        return self._rate(worker, "prefill", tokens, UNMEASURED_PREFILL_TOKENS_PER_S)

    def decode(self, worker: Worker, batch: int) -> tuple[float, bool]:
        return self._rate(worker, "decode", batch, UNMEASURED_DECODE_TOKENS_PER_S)

    def _rate(self, worker: Worker, phase: str, size: int, placeholder: float) -> tuple[float, bool]:
        rate = _curve(worker, phase).at(size)
        if rate is not None:
            return rate, True
        key = (phase, size)
        if key not in self._medians:
            known = [r for r in (_curve(w, phase).at(size) for w in self.candidates) if r is not None]
            self._medians[key] = statistics.median(known) if known else placeholder
        return self._medians[key], False


def _curve(worker: Worker, phase: str) -> RateCurve:
    return worker.prefill_curve if phase == "prefill" else worker.decode_curve


def predict(worker: Worker, prompt_tokens: int, cached_tokens: int, max_tokens: int, rates: RateLookup) -> ScoreTerms:
    """The TTFT a request of ``prompt_tokens`` (``cached_tokens`` of them cached there) would see on ``worker``."""
    queued = round(worker.queued_prefill())
    own = max(prompt_tokens - cached_tokens, 1)  # its last prompt token is always computed
    step = worker.prefill_step_tokens(queued + own)
    prefill_rate, prefill_measured = rates.prefill(worker, step)
    running = worker.queued_requests()
    slots = worker.facts.max_running_requests or running + 1
    batch = max(min(running, slots), 1)
    decode_rate, decode_measured = rates.decode(worker, batch)
    beyond = max(running + 1 - slots, 0)
    step_in_progress = min(running, slots) / decode_rate
    # The requests ahead beyond the slots: their output tokens (the router's average
    # max_tokens there, else this request's) at a full batch's rate.
    output_each = worker.in_flight_work.output / worker.in_flight if worker.in_flight > 0 else max_tokens
    decode_wait = step_in_progress + beyond * output_each / decode_rate
    joined = min(running + 1, slots)  # the batch it decodes in
    output_rate = worker.output_curve.at(joined) or rates.decode(worker, joined)[0]
    prefill_s = (queued + own) / prefill_rate
    # Where requests are running, computing its uncached tokens also holds them up (a
    # prefill step goes before their next decode step): that delay counts once more.
    imposed = own / prefill_rate if running > 0 else 0.0
    utilisation = worker.utilisation()
    queueing = expected_queueing(utilisation, prompt_tokens / prefill_rate)
    return ScoreTerms(
        worker=worker.url,
        queued_prefill_tokens=queued,
        own_prefill_tokens=own,
        cached_tokens=cached_tokens,
        prefill_step_tokens=step,
        prefill_tokens_per_s=prefill_rate,
        running_requests=running,
        decode_batch=batch,
        decode_tokens_per_s=decode_rate,
        requests_beyond_slots=beyond,
        measured=prefill_measured and decode_measured,
        utilisation=utilisation,
        prefill_s=prefill_s,
        decode_wait_s=decode_wait,
        queueing_s=queueing,
        imposed_s=imposed,
        total_s=prefill_s + decode_wait + queueing + imposed,
        ttft_s=prefill_s + decode_wait + queueing,
        output_tokens_per_s=output_rate,
        tpot_s=joined / output_rate,
    )


def expected_queueing(utilisation: float, service_s: float) -> float:
    """The mean wait in a single queue busy ``utilisation`` of the time, for requests of
    ``service_s`` seconds each (M/M/1: S·ρ/(1-ρ), ρ capped at ``UTILISATION_CAP``);
    ``predict`` takes for S the request's whole prompt at the worker's prefill rate.

    The queue snapshot says what a worker holds now; this says what it has been given
    lately, so a worker that took more than its share of the traffic (a sticky prefix
    group, chat sessions, a run of long prompts) looks slower to new prefix groups, and
    its own groups spread once the wait there exceeds prefilling their prefix elsewhere.
    It grows steeply as ρ nears 1: at light load it is small everywhere and the fastest
    prediction wins (a slow worker gets less than its rates' share); at heavy load it
    evens out the workers' utilisation, so that shares follow the rates."""
    rho = min(utilisation, UTILISATION_CAP)
    return service_s * rho / (1 - rho)


@dataclass(frozen=True)
class Decision:
    """One request's placement: the chosen worker and every candidate's score terms."""

    at: float  # Unix seconds
    prompt_tokens: int  # estimated, as the policy saw them
    max_tokens: int
    objective: LatencyObjective | None  # the request's
    text_chars: int  # of the routing text the prefix tree matched
    chosen: str
    candidates: tuple[ScoreTerms, ...]

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "candidates": [asdict(terms) for terms in self.candidates]}


class DecisionLog:
    """The last ``size`` decisions (none kept with ``size`` 0), newest last."""

    def __init__(self, size: int, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._decisions: deque[Decision] = deque(maxlen=size)

    def record(
        self,
        prompt_tokens: int,
        max_tokens: int,
        objective: LatencyObjective | None,
        text_chars: int,
        chosen: str,
        candidates: Sequence[ScoreTerms],
    ) -> None:
        if self._decisions.maxlen:
            self._decisions.append(
                Decision(self.clock(), prompt_tokens, max_tokens, objective, text_chars, chosen, tuple(candidates))
            )

    def last(self, n: int) -> list[dict[str, Any]]:
        """The last ``n`` decisions, oldest first."""
        kept = list(self._decisions)
        return [decision.describe() for decision in kept[max(len(kept) - n, 0) :]]
