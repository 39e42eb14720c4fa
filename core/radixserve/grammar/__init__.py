"""Structured output: the contract between the core and grammar backends.

A grammar backend (registered through the ``register_grammar_backends`` hook,
chosen by ``--grammar-backend``) compiles a ``GrammarSpec`` once into a
``CompiledGrammar``; every request constrained by it gets its own
``GrammarMatcher`` from there. Each step the scheduler asks the matchers of
the constrained rows to fill their row of one token bitmask, and the sampler
applies it to the logits in one call (``apply_token_bitmask``); after sampling
each matcher accepts its request's token.

The bitmask layout is xgrammar's and llguidance's: int32 words, bit ``b`` of
word ``w`` of a row set when token ``32 * w + b`` is allowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "choice"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "ebnf", "choice")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match.

    ``text``: the JSON schema as JSON text (json_schema), the regular expression
    (regex), the grammar in GBNF-style EBNF with a ``root`` rule (ebnf), the
    choices as a JSON list of strings (choice); empty for json_object (any JSON
    object). ``source`` names the request field it came from, for error
    messages; it is not part of the grammar (nor of its cache key)."""

    kind: GrammarKind
    text: str
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"{self.source or self.kind} must be a string, got {type(self.text).__name__}")


class GrammarError(ValueError):
    """A spec the backend cannot compile; the message is the compiler's."""


@dataclass(frozen=True)
class GrammarTokenizer:
    """What a backend needs to know of the model's tokenizer. ``vocab_size`` is
    the logits' width, which may exceed the tokenizer's own vocabulary (tokens
    beyond it are never allowed)."""

    tokenizer: Any  # a HuggingFace tokenizer
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (int32, on the host)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and accepts no more tokens."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""


class CompiledGrammar(ABC):
    """A compiled spec, shared by every request constrained by it (and cached)."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""


class GrammarBackend(ABC):
    """A grammar compiler, built once per scheduler process on first use (off the
    scheduler loop: building reads the whole vocabulary)."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0  # --grammar-backend auto takes the highest

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        """Why this backend cannot load here (e.g. its library is not installed); empty if it can."""
        return []

    @abstractmethod
    def __init__(self, tokenizer: GrammarTokenizer) -> None: ...

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec``; a ``GrammarError`` carrying the compiler's message if it is invalid.
        Called from worker threads, concurrently."""


@dataclass(frozen=True)
class TokenMask:
    """One step's grammar constraints, on the logits' device: row ``i`` of
    ``bitmask`` applies to row ``rows[i]`` of the step's sampled logits."""

    bitmask: torch.Tensor  # [R, ceil(V / 32)] int32
    rows: torch.Tensor  # [R] int64


def allocate_token_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A host bitmask of ``rows`` rows for ``vocab_size`` tokens, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin_memory)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set to -inf, in place, every token that row ``i`` of ``bitmask`` forbids in
    row ``rows[i]`` of ``logits`` ([B, V]); one vectorised pass on the logits' device."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
