"""Simulated requests and the mixes they come in.

A prompt is a sequence of segments (a system prompt, a question, a turn of a chat, a
document, a model's earlier answer), each a run of tokens known by an id; the tokens
themselves never exist. From the segments come both what the worker caches (the block
keys, ``block_keys``) and what the router sees (the routing text, four characters per
token, as its ``TokenEstimator`` assumes): two prompts share a cached prefix and a
routing-text prefix exactly when they share leading segments.

Three kinds of traffic, mixed by weight, with Poisson arrivals:

- shared-prefix groups: one of ``groups`` system prompts, then a question of its own;
- chat sessions: each turn's prompt is the previous turn's prompt, the model's answer
  and a new user message; the next turn comes a think time after the answer ends;
- long documents: a long prompt shared with nothing.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Segment:
    id: int
    tokens: int

    def text(self) -> str:
        tag = f"{self.id:x}|"
        length = self.tokens * CHARS_PER_TOKEN
        return (tag * (length // len(tag) + 1))[:length]


def block_keys(segments: Sequence[Segment], block_size: int) -> list[int]:
    """One key per full block of the token stream: a hash of the block's pieces of
    segments and the key of the block before it."""
    keys: list[int] = []
    previous, pieces, filled = 0, [], 0
    for segment in segments:
        offset = 0
        while offset < segment.tokens:
            take = min(block_size - filled, segment.tokens - offset)
            pieces.append((segment.id, offset))
            offset, filled = offset + take, filled + take
            if filled == block_size:
                previous = hash((previous, tuple(pieces)))
                keys.append(previous)
                pieces, filled = [], 0
    return keys


@dataclass(eq=False)
class SimRequest:
    """One request, and what happened to it (times in simulated seconds)."""

    id: int
    kind: str
    arrival: float
    prompt: tuple[Segment, ...]
    answer: Segment  # the tokens it generates, as the segment a later chat turn repeats
    session: ChatSession | None = None
    worker: Any = None  # the SimulatedWorker it was sent to
    routed: Any = None  # what the router holds for it (router.worker.Work)
    cached_tokens: int = 0  # of its prompt, found in the worker's cache
    computed_tokens: int = 0  # of its prompt, prefilled so far
    held_kv: int = 0  # KV tokens it holds beyond the cached blocks
    locked_blocks: int = 0  # of its blocks, those it holds locked in the worker's cache
    decoding_since: int = 0  # the worker's decode step when it started decoding
    first_token_at: float = -1.0
    finished_at: float = -1.0
    prompt_tokens: int = field(init=False)
    _keys: list[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_tokens = sum(s.tokens for s in self.prompt)

    @property
    def output_tokens(self) -> int:
        return self.answer.tokens

    def prompt_keys(self, block_size: int) -> list[int]:
        if self._keys is None:
            self._keys = block_keys(self.prompt, block_size)
        return self._keys

    def sequence_keys(self, block_size: int) -> list[int]:
        """The blocks of its prompt and answer, as the worker caches them at the end."""
        return block_keys((*self.prompt, self.answer), block_size)

    def text(self) -> str:
        return "".join(s.text() for s in self.prompt)


@dataclass
class ChatSession:
    turns_left: int


@dataclass(frozen=True)
class Mix:
    """What the traffic is made of; weights are of arrivals (a chat arrival starts a session)."""

    shared_prefix: float = 1.0
    chat: float = 1.0
    long_document: float = 1.0
    groups: int = 64
    system_tokens: int = 1024
    question_tokens: int = 64
    answer_tokens: int = 128
    chat_system_tokens: int = 256
    chat_systems: int = 8
    turn_tokens: int = 128
    turn_answer_tokens: int = 192
    mean_turns: float = 4.0
    think_s: float = 5.0
    document_tokens: tuple[int, int] = (3000, 6000)
    document_answer_tokens: int = 64

    def requests_per_arrival(self) -> float:
        total = self.shared_prefix + self.chat + self.long_document
        return (self.shared_prefix + self.chat * self.mean_turns + self.long_document) / total

    def mean_request(self) -> tuple[float, float]:
        """A request's mean prompt and answer tokens (a chat turn at its session's middle)."""
        turn = (self.mean_turns + 1) / 2
        kinds = [
            (self.shared_prefix, self.system_tokens + self.question_tokens, self.answer_tokens),
            (
                self.chat * self.mean_turns,
                self.chat_system_tokens + turn * self.turn_tokens + (turn - 1) * self.turn_answer_tokens,
                self.turn_answer_tokens,
            ),
            (self.long_document, sum(self.document_tokens) / 2, self.document_answer_tokens),
        ]
        weight = sum(w for w, _, _ in kinds)
        return sum(w * p for w, p, _ in kinds) / weight, sum(w * a for w, _, a in kinds) / weight


class Trace:
    """Given requests, arriving at their ``arrival`` times, with no follow-ups."""

    def __init__(self, requests: Sequence[SimRequest]):
        self.requests = sorted(requests, key=lambda r: r.arrival)

    def arrivals(self) -> Iterator[SimRequest]:
        return iter(self.requests)

    def follow_up(self, request: SimRequest, now: float) -> SimRequest | None:
        return None


class Workload:
    """``requests`` requests of ``mix`` at ``rate`` requests per second (Poisson)."""

    def __init__(self, mix: Mix, requests: int, rate: float, seed: int = 0):
        self.mix, self.rate = mix, rate
        self.remaining = requests
        self.rng = random.Random(seed)
        self._ids = itertools.count()
        self._segments = itertools.count()
        self.groups = [Segment(next(self._segments), mix.system_tokens) for _ in range(mix.groups)]
        self.chat_systems = [Segment(next(self._segments), mix.chat_system_tokens) for _ in range(mix.chat_systems)]

    def arrivals(self) -> Iterator[SimRequest]:
        """The requests that start something (not later chat turns), in time order."""
        mix, now = self.mix, 0.0
        kinds = ("shared_prefix", "chat", "long_document")
        weights = (mix.shared_prefix, mix.chat, mix.long_document)
        start_rate = self.rate / mix.requests_per_arrival()
        while self.remaining > 0:
            now += self.rng.expovariate(start_rate)
            kind = self.rng.choices(kinds, weights)[0]
            if kind == "shared_prefix":
                group = self.rng.choice(self.groups)
                yield self._request(kind, now, (group, self._fresh(mix.question_tokens)), mix.answer_tokens)
            elif kind == "chat":
                session = ChatSession(1 + self._geometric(mix.mean_turns - 1))
                system = self.rng.choice(self.chat_systems)
                prompt = (system, self._fresh(mix.turn_tokens))
                yield self._request(kind, now, prompt, mix.turn_answer_tokens, session)
            else:
                tokens = self.rng.randint(*mix.document_tokens)
                yield self._request(kind, now, (Segment(next(self._segments), tokens),), mix.document_answer_tokens)

    def follow_up(self, request: SimRequest, now: float) -> SimRequest | None:
        """The next turn of ``request``'s chat session, when there is one."""
        session = request.session
        if session is None or self.remaining <= 0:
            return None
        session.turns_left -= 1
        if session.turns_left <= 0:
            return None
        prompt = (*request.prompt, request.answer, self._fresh(self.mix.turn_tokens))
        at = now + self.rng.expovariate(1 / self.mix.think_s)
        return self._request("chat", at, prompt, self.mix.turn_answer_tokens, session)

    def _request(
        self, kind: str, at: float, prompt: tuple[Segment, ...], answer_tokens: int, session: ChatSession | None = None
    ) -> SimRequest:
        self.remaining -= 1
        answer = self._fresh(max(1, round(answer_tokens * self.rng.uniform(0.5, 1.5))))
        return SimRequest(next(self._ids), kind, at, prompt, answer, session)

    def _fresh(self, tokens: int) -> Segment:
        return Segment(next(self._segments), tokens)

    def _geometric(self, mean: float) -> int:
        """A count >= 0 with the given mean."""
        if mean <= 0:
            return 0
        p, count = 1 / (mean + 1), 0
        while self.rng.random() > p:
            count += 1
        return count
