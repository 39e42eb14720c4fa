"""Routing policies: which of the candidate workers (same model, healthy, breaker closed,
supporting what the request needs) gets a request.

- ``latency_aware`` (the default): the least predicted time to first token
  (``latency.predict``): the prompt tokens queued ahead plus the request's own less what
  the worker caches (``PrefixTree``), at the worker's prefill rate for that step size, and
  the decode work it waits behind, at the decode rate for that batch size; each rate the
  worker's own, measured per batch-size band; plus the queueing its recent utilisation
  implies (the prompt work routed to it over the last minutes). A prefix group stays
  where it is cached until the wait there costs more than prefilling the prefix
  elsewhere; equal workers end with equal shares; at heavy load a slower worker gets a
  share in proportion to its rates, at light load less (its prediction is the longer
  one). Past 16 candidates only the prefix's holders and a random few are scored. Each
  decision is kept for ``GET /debug/decisions``.
- ``capacity_aware`` (P11's default, kept for comparison): the least expected time to the
  request's end: the work queued on it plus this request's, less the prompt tokens it
  caches, at the recent peak of the worker's overall prefill and decode throughput.
- ``cache_aware``: SGLang's rule. Unless the load is imbalanced (then ``shortest_queue``'s
  pick), the worker with the longest cached prefix when it covers ``cache_threshold`` of
  the request, else the worker credited with the least text (spreading new prefixes).
- ``round_robin``, ``shortest_queue``, ``minimum_tokens``: the rules the data-parallel
  controller uses for its replicas (``load_balance.py``), over each worker's ``Load``
  as the router knows it (``worker_load``); ties in turn.
- ``power_of_two`` (of two at random, the one ``minimum_tokens`` would pick), ``random``.
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from radixserve.load_balance import LOAD_KEYS, Load, least_loaded
from radixserve.router.args import RouterArgs
from radixserve.router.latency import DecisionLog, LatencyObjective, RateLookup, predict
from radixserve.router.prefix_tree import PrefixTree
from radixserve.router.worker import Work, Worker

# The candidates latency_aware scores (LatencyAware); SCORE_ALL_UP_TO >= SAMPLED_SCORED.
SCORE_ALL_UP_TO = 16
MATCHED_SCORED = 4
SAMPLED_SCORED = 16
# Predicted TTFTs within this fraction of the least count as equal (LatencyAware).
NEAR_TIE = 0.25


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy knows of a request: its routing text (the prompt, or the chat
    messages flattened in order), estimated token counts, and the latency objectives it
    states (``latency_aware`` meets them where it can; the other policies ignore them)."""

    text: str
    prompt_tokens: int
    max_tokens: int
    objective: LatencyObjective | None = None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class Choice:
    worker: Worker
    cached_tokens: int = 0  # of the request's prompt, as the policy believes the worker caches it

    @staticmethod
    def of(worker: Worker, request: RoutingRequest, matched_chars: int) -> Choice:
        share = matched_chars / len(request.text) if request.text else 0.0
        return Choice(worker, int(request.prompt_tokens * share))

    def work(self, request: RoutingRequest) -> Work:
        """What the request adds to the worker's queue."""
        return Work(request.prompt_tokens - self.cached_tokens, request.max_tokens)


class Policy(Protocol):
    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Choice: ...

    def forget(self, url: str) -> None:
        """The worker left the fleet."""


class _Forgetful:
    """A policy that remembers nothing of a worker."""

    def forget(self, url: str) -> None:
        pass


def worker_load(worker: Worker) -> Load:
    """A worker's unfinished requests and tokens, as the router knows them (``Worker.queued_*``)."""
    return Load(worker.queued_requests(), worker.queued_tokens())


class InTurn(_Forgetful):
    """``round_robin``, ``shortest_queue`` or ``minimum_tokens`` (``load_balance.LOAD_KEYS``):
    the least loaded candidate, the first of equals counting from the one after the
    last chosen (as the DP controller does with its replicas)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._next = 0  # the candidate's place to try first

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Choice:
        if self.policy == "round_robin":  # the next in turn whatever the loads: not worth reading them
            chosen = self._next % len(candidates)
        else:
            chosen = least_loaded([worker_load(w) for w in candidates], self.policy, self._next % len(candidates))
        self._next = chosen + 1
        return Choice(candidates[chosen])


class RandomChoice(_Forgetful):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Choice:
        return Choice(self.rng.choice(list(candidates)))


class PowerOfTwo(_Forgetful):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Choice:
        if len(candidates) == 1:
            return Choice(candidates[0])
        pair = self.rng.sample(list(candidates), 2)
        return Choice(pair[least_loaded([worker_load(w) for w in pair], "minimum_tokens")])


class CacheAware:
    def __init__(self, tree: PrefixTree, threshold: float, balance_abs: int, balance_rel: float):
        self.tree, self.threshold = tree, threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Choice:
        loads = [w.queued_requests() for w in candidates]
        imbalanced = max(loads) - min(loads) > self.balance_abs and max(loads) > min(loads) * self.balance_rel
        matched = self.tree.match(request.text)
        if imbalanced:
            chosen = candidates[least_loaded([worker_load(w) for w in candidates], "shortest_queue")]
        else:
            best = max(candidates, key=lambda w: (matched.get(w.url, 0), -w.queued_requests()))
            if request.text and matched.get(best.url, 0) / len(request.text) >= self.threshold:
                chosen = best
            else:
                chosen = min(candidates, key=lambda w: (self.tree.chars.get(w.url, 0), w.queued_requests()))
        self.tree.insert(request.text, chosen.url)
        return Choice.of(chosen, request, matched.get(chosen.url, 0))

    def forget(self, url: str) -> None:
        self.tree.remove_worker(url)


class CapacityAware:
    def __init__(self, tree: PrefixTree):
        self.tree = tree

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Choice:
        matched = self.tree.match(request.text)
        prefill = _capacities(candidates, lambda w: w.prefill_capacity.value)
        decode = _capacities(candidates, lambda w: w.decode_capacity.value)
        choices = [Choice.of(w, request, matched.get(w.url, 0)) for w in candidates]
        best = min(choices, key=lambda c: self.cost(c, request, prefill[c.worker.url], decode[c.worker.url]))
        self.tree.insert(request.text, best.worker.url)
        return best

    @staticmethod
    def cost(choice: Choice, request: RoutingRequest, prefill_speed: float, decode_speed: float) -> float:
        """Seconds of work ahead of the request's end on the worker, at its measured rates:
        the prompt tokens to compute there (queued, then the request's uncached ones) at its
        prefill rate, and the output tokens at its decode rate."""
        queued, own = choice.worker.queued_work(), choice.work(request)
        return (queued.prompt + own.prompt) / prefill_speed + (queued.output + own.output) / decode_speed

    def forget(self, url: str) -> None:
        self.tree.remove_worker(url)


class LatencyAware:
    """The candidate with the least predicted TTFT (``latency.predict``, its queueing term
    included). Predictions within ``NEAR_TIE`` of the least are taken as ties, as long as
    the prompt tokens they would compute are too (a near tie never moves a request off
    its cached prefix): ties go to the least utilised (``Worker.utilisation``), then to the
    one with the fewest unfinished requests, then in turn. A request with latency
    objectives is placed so among the candidates predicted to meet them (its time to
    first token and per output token, ``LatencyObjective``), or, where none is, on the
    one that misses them by the least. A prediction is no more exact
    than the rates it divides by, and equal workers' measured rates differ by a fifth
    where they share a host's cores; taken at face value, that difference, not the work
    each was given, would decide which of them gets a new prefix group.

    A fleet of up to ``SCORE_ALL_UP_TO`` candidates is scored whole. Of a larger one only
    the ``MATCHED_SCORED`` workers caching the longest prefix of the request and
    ``SAMPLED_SCORED`` drawn at random are scored (the power of d choices: the best of a
    few at random is nearly as lightly loaded as the best of all), so a decision costs
    the same at any fleet size; ``/debug/decisions`` then lists the scored candidates."""

    def __init__(self, tree: PrefixTree, decisions: DecisionLog | None = None, rng: random.Random | None = None):
        self.tree = tree
        self.decisions = decisions or DecisionLog(0)
        self.rng = rng or random.Random()
        self._next = 0  # the candidate's place to try first among equals
        self._fleet: list[Worker] = []  # the last candidates seen, and their places by url
        self._place: dict[str, int] = {}

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Choice:
        matched = self.tree.match(request.text)
        n, first = len(candidates), self._next % len(candidates)
        scored = sorted(self._scored(candidates, matched), key=lambda i: (i - first) % n)  # in turn from first
        workers = [candidates[i] for i in scored]
        rates = RateLookup(workers)
        choices = [Choice.of(w, request, matched.get(w.url, 0)) for w in workers]
        terms = [predict(c.worker, request.prompt_tokens, c.cached_tokens, request.max_tokens, rates) for c in choices]
        eligible = list(range(len(terms)))
        if request.objective is not None:
            excess = [request.objective.excess(t) for t in terms]
            meeting = [k for k in eligible if excess[k] <= 1]
            eligible = meeting or [min(eligible, key=excess.__getitem__)]
        best = min(eligible, key=lambda k: terms[k].total_s)
        near = [
            k
            for k in eligible
            if terms[k].total_s <= terms[best].total_s * (1 + NEAR_TIE)
            and terms[k].own_prefill_tokens <= terms[best].own_prefill_tokens * (1 + NEAR_TIE)
        ]
        best = min(near, key=lambda k: (terms[k].utilisation, terms[k].running_requests))
        # min keeps the first of equals: the earliest in turn
        self._next = scored[best] + 1
        chosen = choices[best]
        self.tree.insert(request.text, chosen.worker.url)
        self.decisions.record(
            request.prompt_tokens, request.max_tokens, request.objective, len(request.text), chosen.worker.url, terms
        )
        return chosen

    def _scored(self, candidates: Sequence[Worker], matched: dict[str, int]) -> set[int]:
        """The places of the candidates to score."""
        n = len(candidates)
        if n <= SCORE_ALL_UP_TO:
            return set(range(n))
        fleet = list(candidates)
        if fleet != self._fleet:  # Worker compares by identity: a C-level scan
            self._fleet, self._place = fleet, {w.url: i for i, w in enumerate(fleet)}
        cached = heapq.nlargest(MATCHED_SCORED, (url for url in matched if url in self._place), key=matched.__getitem__)
        return {self._place[url] for url in cached} | set(self.rng.sample(range(n), SAMPLED_SCORED))

    def forget(self, url: str) -> None:
        self.tree.remove_worker(url)


def _capacities(candidates: Sequence[Worker], rate: Callable[[Worker], float | None]) -> dict[str, float]:
    """Each worker's capacity (tokens/s); one not measured yet counts as the median of the
    others (or all as 1.0), so that it gets traffic and is measured."""
    known = [r for r in map(rate, candidates) if r]
    default = statistics.median(known) if known else 1.0
    return {w.url: rate(w) or default for w in candidates}


@dataclass(frozen=True)
class PairPolicies:
    """With ``--pd-disaggregation``: the policies choosing a request's prefill worker
    (``--prefill-policy``) and its decode worker (``--decode-policy``), each with its own
    state (a prefix tree over the prefill workers is what cache affinity needs)."""

    prefill: Policy
    decode: Policy

    @classmethod
    def of(cls, args: RouterArgs) -> PairPolicies:
        return cls(make_policy(args, name=args.prefill_policy), make_policy(args, name=args.decode_policy))


def make_policy(
    args: RouterArgs,
    rng: random.Random | None = None,
    decisions: DecisionLog | None = None,
    name: str | None = None,
) -> Policy:
    """``decisions``: where ``latency_aware`` keeps its last decisions (the others keep none);
    ``name``: the policy (default ``args.policy``)."""
    rng = rng or random.Random()
    name = name or args.policy
    if name in LOAD_KEYS:
        return InTurn(name)
    if name == "random":
        return RandomChoice(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    tree = PrefixTree(args.max_tree_size, args.max_tree_total_chars)
    if name == "cache_aware":
        return CacheAware(tree, args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold)
    if name == "capacity_aware":
        return CapacityAware(tree)
    return LatencyAware(tree, decisions, rng)
