"""Routing policies: which of the candidate workers (same model, healthy, breaker closed,
supporting what the request needs) gets a request.

- ``capacity_aware`` (the default): the least expected wait. A worker's cost is the work
  queued on it plus this request's, in tokens, less the prompt tokens it already caches
  (``PrefixTree``), divided by its measured decode throughput. A worker half as fast gets
  half the traffic at equal queues; a long prompt goes where the queue is short or its
  prefix is cached.
- ``cache_aware``: SGLang's rule. Unless the load is imbalanced (then the least loaded),
  the worker with the longest cached prefix when it covers ``cache_threshold`` of the
  request, else the worker credited with the least text (spreading new prefixes).
- ``round_robin``, ``power_of_two`` (the less loaded of two at random), ``random``.
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from radixserve.router.args import RouterArgs
from radixserve.router.prefix_tree import PrefixTree
from radixserve.router.worker import Worker


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy knows of a request: its routing text (the prompt, or the chat
    messages flattened in order) and estimated token counts."""

    text: str
    prompt_tokens: int
    max_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


class Policy(Protocol):
    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Worker: ...

    def forget(self, url: str) -> None:
        """The worker left the fleet."""


class _Forgetful:
    """A policy that remembers nothing of a worker."""

    def forget(self, url: str) -> None:
        pass


class RoundRobin(_Forgetful):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Worker:
        return candidates[next(self._counter) % len(candidates)]


class RandomChoice(_Forgetful):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Worker:
        return self.rng.choice(list(candidates))


class PowerOfTwo(_Forgetful):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(list(candidates), 2)
        return a if a.queued_tokens() <= b.queued_tokens() else b


class CacheAware:
    def __init__(self, tree: PrefixTree, threshold: float, balance_abs: int, balance_rel: float):
        self.tree, self.threshold = tree, threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Worker:
        loads = [w.queued_requests() for w in candidates]
        least_loaded = candidates[loads.index(min(loads))]
        imbalanced = max(loads) - min(loads) > self.balance_abs and max(loads) > min(loads) * self.balance_rel
        if imbalanced:
            chosen = least_loaded
        else:
            matched = self.tree.match(request.text)
            best = max(candidates, key=lambda w: (matched.get(w.url, 0), -w.queued_requests()))
            if request.text and matched.get(best.url, 0) / len(request.text) >= self.threshold:
                chosen = best
            else:
                chosen = min(candidates, key=lambda w: (self.tree.chars.get(w.url, 0), w.queued_requests()))
        self.tree.insert(request.text, chosen.url)
        return chosen

    def forget(self, url: str) -> None:
        self.tree.remove_worker(url)


class CapacityAware:
    def __init__(self, tree: PrefixTree):
        self.tree = tree

    def choose(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Worker:
        matched = self.tree.match(request.text)
        speeds = _speeds(candidates)
        chosen = min(candidates, key=lambda w: self.cost(w, request, matched.get(w.url, 0), speeds[w.url]))
        self.tree.insert(request.text, chosen.url)
        return chosen

    @staticmethod
    def cost(worker: Worker, request: RoutingRequest, matched_chars: int, speed: float) -> float:
        """Seconds of work ahead of the request's end on ``worker`` (at its measured rate)."""
        cached = request.prompt_tokens * matched_chars / len(request.text) if request.text else 0.0
        return (worker.queued_tokens() + request.tokens - cached) / speed

    def forget(self, url: str) -> None:
        self.tree.remove_worker(url)


def _speeds(candidates: Sequence[Worker]) -> dict[str, float]:
    """Each worker's decode tokens/s; one not measured yet counts as the median of the
    others (or all as 1.0), so that it gets traffic and is measured."""
    known = [w.load.decode_tokens_per_s for w in candidates if w.load.decode_tokens_per_s]
    default = statistics.median(known) if known else 1.0
    return {w.url: w.load.decode_tokens_per_s or default for w in candidates}


def make_policy(args: RouterArgs, rng: Optional[random.Random] = None) -> Policy:
    rng = rng or random.Random()
    if args.policy == "round_robin":
        return RoundRobin()
    if args.policy == "random":
        return RandomChoice(rng)
    if args.policy == "power_of_two":
        return PowerOfTwo(rng)
    tree = PrefixTree(args.max_tree_size)
    if args.policy == "cache_aware":
        return CacheAware(tree, args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold)
    return CapacityAware(tree)
