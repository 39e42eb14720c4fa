"""Per-request sampling parameters, named as in SGLang's ``sampling_params``.

Construction only normalizes shapes (``stop`` becomes a list, JSON's string keys
of ``logit_bias`` become ints); ``validate`` is what rejects bad values, with a
message that starts with the field name so the server can report it as is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from radixserve.request_limits import SamplingLimits, has_lone_surrogate
from radixserve.structured_output.backend import GrammarSpec, ReasoningGate

# Temperatures below this sample from a distribution so peaked that argmax is
# the only sensible reading, and dividing by them overflows float32.
GREEDY_TEMPERATURE = 1e-6
# Integers become int64 tensors in the scheduler; a larger one must not get that far.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = field(default_factory=list)  # a list after __post_init__
    stop_token_ids: list[int] | None = field(default_factory=list)  # a list after __post_init__
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    # Structured output: what the output must match (the API layers build it from
    # response_format, regex, json_schema, ebnf and their aliases).
    grammar: GrammarSpec | None = None
    # With a reasoning parser: the grammar applies only after the reasoning (grammar.GatedMatcher).
    grammar_gate: ReasoningGate | None = None

    def __post_init__(self) -> None:
        # Normalize only what has the right shape; validate() reports the rest. Callers
        # (JSON, Python) may pass any value, a tuple say, whatever the annotations say.
        stop: object = self.stop
        if stop is None:
            self.stop = []
        elif isinstance(stop, str):
            self.stop = [stop]
        elif isinstance(stop, tuple):
            self.stop = list(stop)
        stop_token_ids: object = self.stop_token_ids
        if stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(stop_token_ids, tuple):
            self.stop_token_ids = list(stop_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's JSON object; unknown keys are an error."""
        d = d or {}
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
        return cls(**d)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the request's token history."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None, limits: SamplingLimits | None = None) -> None:
        """Raise ValueError naming the first bad field; ``vocab_size`` bounds token
        ids, ``limits`` (the server's flags) bound ``n`` and the stop strings."""
        _int("max_new_tokens", self.max_new_tokens, low=0)
        _int("min_new_tokens", self.min_new_tokens, low=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )
        _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        _float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _float("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _float(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be an object of token id -> bias, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                _token_id("logit_bias", token, vocab_size)
                _float("logit_bias", bias)
                if not -100 <= bias <= 100:  # OpenAI's range; larger would overflow the logits
                    raise ValueError(f"logit_bias must hold biases in [-100, 100], got {bias} for token {token}")
        if self.seed is not None:
            _int("seed", self.seed)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if any(has_lone_surrogate(s) for s in self.stop):
            raise ValueError("stop must be valid Unicode text, without lone UTF-16 surrogates")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            _token_id("stop_token_ids", token, vocab_size)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        _int("n", self.n, low=1)
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
            if self.min_new_tokens:
                # The grammar may allow only the end of the output while min_new_tokens forbids it.
                raise ValueError("min_new_tokens cannot be combined with structured output")
        if self.grammar_gate is not None and not isinstance(self.grammar_gate, ReasoningGate):
            raise ValueError(f"grammar_gate must be a ReasoningGate, got {type(self.grammar_gate).__name__}")
        if limits is not None:
            _check_limits(self.n, self.stop, limits)


def _check_limits(n: int, stop: list[str], limits: SamplingLimits) -> None:
    if n > limits.max_n:
        raise ValueError(f"n must be <= {limits.max_n} (the server's --max-n), got {n}")
    if len(stop) > limits.max_stop_strings:
        raise ValueError(
            f"stop must hold at most {limits.max_stop_strings} strings (the server's "
            f"--max-stop-strings), got {len(stop)}"
        )
    chars = sum(len(s) for s in stop)
    if chars > limits.max_stop_chars:
        raise ValueError(
            f"stop must total at most {limits.max_stop_chars} characters over all its strings (the "
            f"server's --max-stop-chars), got {chars}"
        )


def _token_key(key: Any) -> Any:
    """JSON object keys are strings: accept "42" for token 42."""
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return key  # validate() reports it
    return key


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value: Any, low: int | None = None) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in 64 bits, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _float(name: str, value: Any) -> None:
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _token_id(name: str, value: Any, vocab_size: int | None) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must hold integer token ids, got {value!r}")
    if value < 0 or (vocab_size is not None and value >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name} token id {value} is out of range {bound}")
