"""Load-balancing policies: one vocabulary for the data-parallel controller
(``--load-balance-method``: which replica gets a request) and the router
(``radixserve router --policy``: which worker gets it).

``POLICIES`` names every policy once, with its meaning and which of the two
has it; both flags take their choices from it (``LoadBalanceMethod`` and
``RouterPolicy`` are its two columns as types). A name means the same thing in
both places: ``round_robin``, ``shortest_queue`` and ``minimum_tokens`` are one
rule over a target's ``Load`` (``least_loaded``), whether the target is a
replica (the load the DP controller dispatched and has not seen finish,
``runtime/processes/dp_controller.py`` says why it counts rather than asks) or
a worker (what the router has in flight there, or what the worker reports when
that is more, ``router/worker.py``). The router's other policies need what only
it keeps (prefix trees, measured rates) or pick at random.

Ties go in turn, so equally loaded targets (an idle server, one request at a
time) are used one after the other rather than the first one always.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from radixserve.messages import GenerateRequest

User = Literal["dp", "router"]


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    meaning: str  # one line, as the flags' help shows it
    dp: bool  # --load-balance-method has it
    router: bool  # radixserve router --policy has it


POLICIES: dict[str, PolicyInfo] = {
    p.name: p
    for p in (
        PolicyInfo("round_robin", "each target in turn", dp=True, router=True),
        PolicyInfo("shortest_queue", "the fewest unfinished requests", dp=True, router=True),
        PolicyInfo(
            "minimum_tokens",
            "the fewest unfinished tokens: prompt plus max new tokens per request",
            dp=True,
            router=True,
        ),
        PolicyInfo(
            "latency_aware",
            "the least predicted time to first token: prompt tokens queued ahead plus the request's uncached ones "
            "at the worker's prefill rate for that step size, and the decode work it waits behind at the decode "
            "rate for that batch size, both measured per batch-size band",
            dp=False,
            router=True,
        ),
        PolicyInfo(
            "capacity_aware",
            "the least expected wait: queued tokens over the worker's peak measured throughput, less the prompt "
            "tokens it caches (P11's default)",
            dp=False,
            router=True,
        ),
        PolicyInfo(
            "cache_aware",
            "the longest cached prefix above --cache-threshold, or shortest_queue's pick when the load is imbalanced",
            dp=False,
            router=True,
        ),
        PolicyInfo(
            "power_of_two", "of two targets at random, the one minimum_tokens would pick", dp=False, router=True
        ),
        PolicyInfo("random", "a target at random", dp=False, router=True),
    )
}

LoadBalanceMethod = Literal["round_robin", "shortest_queue", "minimum_tokens"]
RouterPolicy = Literal[
    "capacity_aware",
    "latency_aware",
    "cache_aware",
    "round_robin",
    "shortest_queue",
    "minimum_tokens",
    "power_of_two",
    "random",
]
DP_POLICIES: tuple[str, ...] = typing.get_args(LoadBalanceMethod)
ROUTER_POLICIES: tuple[str, ...] = typing.get_args(RouterPolicy)
assert set(DP_POLICIES) == {p.name for p in POLICIES.values() if p.dp}
assert set(ROUTER_POLICIES) == {p.name for p in POLICIES.values() if p.router}

_USERS: dict[str, tuple[tuple[str, ...], str]] = {
    "dp": (DP_POLICIES, "--load-balance-method"),
    "router": (ROUTER_POLICIES, "radixserve router --policy"),
}


def describe(user: User) -> str:
    """The policies ``user`` has, each with its meaning (for a flag's help)."""
    return "; ".join(f"{name} ({POLICIES[name].meaning})" for name in _USERS[user][0])


def policy_error(name: str, user: User) -> str | None:
    """Why ``user`` cannot take the policy ``name``; None when it can."""
    names, _ = _USERS[user]
    if name in names:
        return None
    reason = f"must be one of {', '.join(names)}, got {name!r}"
    others = [where for other, (their, where) in _USERS.items() if other != user and name in their]
    return reason + (f" (only {others[0]} has it)" if others else "")


@dataclass
class Load:
    """A target's unfinished requests and their tokens."""

    requests: int = 0
    tokens: int = 0

    def add(self, tokens: int) -> None:
        self.requests += 1
        self.tokens += tokens

    def remove(self, tokens: int) -> None:
        self.requests -= 1
        self.tokens -= tokens


def request_tokens(req: GenerateRequest) -> int:
    """A request's weight under ``minimum_tokens``: its prompt plus the tokens it may generate."""
    return len(req.input_ids) + req.sampling_params.max_new_tokens


# The policies that pick the least loaded target by a key of its Load (round_robin: no key, so the next in turn).
LOAD_KEYS: dict[str, Callable[[Load], tuple[int, ...]]] = {
    "round_robin": lambda load: (),
    "shortest_queue": lambda load: (load.requests, load.tokens),
    "minimum_tokens": lambda load: (load.tokens, load.requests),
}


def least_loaded(loads: Sequence[Load], policy: str, first: int = 0) -> int:
    """The index in ``loads`` that ``policy`` (one of ``LOAD_KEYS``) picks: the least
    loaded, the first of equals counting from ``first`` (and round from the end)."""
    key = LOAD_KEYS[policy]
    n = len(loads)
    return min(((first + i) % n for i in range(n)), key=lambda i: key(loads[i]))


class LoadBalancer:
    """The data-parallel controller's choice of a replica, by dp rank."""

    def __init__(self, method: str):
        error = policy_error(method, "dp")
        if error is not None:
            raise ValueError(f"load_balance_method: {error}")
        self.method = method
        self._next = 0  # the dp rank to try first (ties in turn)

    def choose(self, loads: Mapping[int, Load]) -> int:
        """The dp rank to send the next request to, among ``loads``' (the live
        replicas'); ValueError when there is none."""
        if not loads:
            raise ValueError("no data-parallel replica is alive")
        ranks = sorted(loads)
        start = next((i for i, rank in enumerate(ranks) if rank >= self._next), 0)
        chosen = ranks[least_loaded([loads[rank] for rank in ranks], self.method, start)]
        self._next = chosen + 1
        return chosen
