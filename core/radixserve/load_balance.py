"""The data-parallel controller's choice of a replica (``--load-balance-method``).

A policy sees one ``ReplicaLoad`` per live replica: what the controller has
dispatched to it and not yet seen finish (``runtime/processes/dp_controller.py`` says why
it counts rather than asks). ``round_robin`` cycles through the live replicas;
``shortest_queue`` takes the one with the fewest unfinished requests;
``minimum_tokens`` the one with the fewest unfinished tokens (each request
counts its prompt plus its ``max_new_tokens``, the most KV it can come to hold).
Ties go round robin, so equally loaded replicas (an idle server, one request at
a time) are used in turn rather than the first one always.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from radixserve.config import LoadBalanceMethod
from radixserve.messages import GenerateRequest


@dataclass
class ReplicaLoad:
    """Requests dispatched to a replica that have not finished, and their tokens."""

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


_KEYS: dict[str, Callable[[ReplicaLoad], tuple[int, ...]]] = {
    "round_robin": lambda load: (),
    "shortest_queue": lambda load: (load.requests, load.tokens),
    "minimum_tokens": lambda load: (load.tokens, load.requests),
}


class LoadBalancer:
    def __init__(self, method: LoadBalanceMethod):
        if method not in _KEYS:
            raise ValueError(f"load_balance_method: unknown method {method!r}, expected one of {sorted(_KEYS)}")
        self.method = method
        self._key = _KEYS[method]
        self._next = 0  # the round-robin cursor: the dp rank to try first

    def choose(self, loads: Mapping[int, ReplicaLoad]) -> int:
        """The dp rank to send the next request to, among ``loads``' (the live
        replicas'); ValueError when there is none."""
        if not loads:
            raise ValueError("no data-parallel replica is alive")
        ranks = sorted(loads)
        start = next((i for i, rank in enumerate(ranks) if rank >= self._next), 0)
        in_turn = ranks[start:] + ranks[:start]
        chosen = min(in_turn, key=lambda rank: self._key(loads[rank]))  # min keeps the first of equals
        self._next = chosen + 1
        return chosen
