"""Structured output: the contract between the core and grammar backends.

A grammar backend (registered through the ``register_grammar_backends`` hook,
chosen by ``--grammar-backend``) compiles a ``GrammarSpec`` once into a
``CompiledGrammar``; every request constrained by it gets its own
``GrammarMatcher`` from there. Each step the scheduler asks the matchers of
the constrained rows to fill their row of one token bitmask, and the sampler
applies it to the logits in one call (the elementwise backend's
``apply_token_bitmask``, so that a plugin's kernel does it); after sampling
each matcher accepts its request's token.

The bitmask layout is xgrammar's and llguidance's: int32 words, bit ``b`` of
word ``w`` of a row set when token ``32 * w + b`` is allowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:  # imported where a bitmask is made: the detokenizer imports this module (messages) without torch
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
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin_memory)


@dataclass(frozen=True)
class ReasoningGate:
    """Where a grammar starts when the model reasons first (``--reasoning-parser``):
    the reasoning tags as token ids. ``starts_in_reasoning``: the prompt already
    opened the reasoning (DeepSeek-R1), so the output is free text up to
    ``end_ids``; otherwise the output may open it with ``start_ids`` first (Qwen3)
    or start straight with the grammar."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    starts_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if not self.start_ids or not self.end_ids:
            raise ValueError("a reasoning gate needs non-empty start and end tags")


class GatedMatcher(GrammarMatcher):
    """A grammar that applies only after the reasoning: free text (every token
    allowed) from the start tag to the end tag, then ``inner``. Before anything
    is generated the first token may be the start tag's (opening the reasoning)
    or one the grammar allows; once the start tag's first token is taken its
    other tokens are forced. The tags are matched as the token sequences given
    (a model that spells ``</think>`` with other tokens stays in free text)."""

    def __init__(self, inner: GrammarMatcher, gate: ReasoningGate):
        self.inner, self.gate = inner, gate
        self.history: list[tuple[str, int]] = []  # (phase the token was accepted in, token)
        self.phase = "reasoning" if gate.starts_in_reasoning else "before"
        self.opened = 0  # start-tag tokens taken
        self.recent: list[int] = []  # the reasoning's last tokens, to spot the end tag

    def _advance(self, phase: str, token: int) -> None:
        if phase == "before":
            if token == self.gate.start_ids[0]:
                self.opened = 1
                self.phase = "opening" if len(self.gate.start_ids) > 1 else "reasoning"
            else:
                self.phase = "grammar"
        elif phase == "opening":
            self.opened += 1
            if self.opened == len(self.gate.start_ids):
                self.phase = "reasoning"
        elif phase == "reasoning":
            self.recent = (self.recent + [token])[-len(self.gate.end_ids) :]
            if tuple(self.recent) == self.gate.end_ids:
                self.phase = "grammar"

    def accept_token(self, token: int) -> bool:
        phase = self.phase
        if phase == "grammar" or (phase == "before" and token != self.gate.start_ids[0]):
            if not self.inner.accept_token(token):
                return False
        elif phase == "opening" and token != self.gate.start_ids[self.opened]:
            return False
        self.history.append((phase, token))
        self._advance(phase, token)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.phase == "grammar":
            self.inner.fill_bitmask(bitmask, row)
        elif self.phase == "reasoning":
            bitmask[row] = -1
        elif self.phase == "opening":
            bitmask[row] = 0
            _allow(bitmask, row, self.gate.start_ids[self.opened])
        else:
            self.inner.fill_bitmask(bitmask, row)
            _allow(bitmask, row, self.gate.start_ids[0])

    def is_terminated(self) -> bool:
        return self.phase == "grammar" and self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        undone, self.history = (
            self.history[len(self.history) - num_tokens :],
            self.history[: len(self.history) - num_tokens],
        )
        inner_tokens = sum(
            1 for phase, tok in undone if phase == "grammar" or (phase == "before" and tok != self.gate.start_ids[0])
        )
        if inner_tokens:
            self.inner.rollback(inner_tokens)
        self.phase = "reasoning" if self.gate.starts_in_reasoning else "before"
        self.opened, self.recent = 0, []
        for phase, token in self.history:
            self._advance(phase, token)


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set token ``token``'s bit in row ``row`` (int32 words: bit 31 is the sign bit)."""
    word, bit = divmod(token, 32)
    if word < bitmask.shape[1]:
        value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
