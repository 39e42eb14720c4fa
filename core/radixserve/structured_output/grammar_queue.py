"""Structured output in the scheduler: the queue of requests whose grammar is
compiling, and each step's grammar work.

A request with a grammar waits here, not in the waiting queue, until its
compile (``GrammarCompiler``, off the scheduler loop) is done: then it gets its
own matcher and joins the waiting queue; a failed compile, or one that takes
longer than ``--grammar-compile-timeout``, ends it with a 400. Other requests
run meanwhile. An abort drops it from here: it holds no KV yet.

With tensor parallelism every rank compiles, and rank 0 decides which pending
requests are settled (done or timed out) and broadcasts the decision, so all
ranks move the same requests at the same step.

Per step, ``step_mask`` fills one bitmask for the constrained rows (None, and
no work at all, when no running request has a grammar) and ``accept`` advances
a request's matcher by its sampled token after the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from radixserve.config import ServerArgs
from radixserve.messages import FinishReason
from radixserve.runtime.execution.distributed import TPGroup
from radixserve.runtime.execution.model_runner import ModelRunner
from radixserve.runtime.execution.request import Req
from radixserve.structured_output.backend import (
    CompiledGrammar,
    GatedMatcher,
    GrammarBackend,
    GrammarError,
    GrammarTokenizer,
    TokenMask,
    allocate_token_bitmask,
)
from radixserve.structured_output.grammar_compiler import GrammarCompiler
from radixserve.transfer import HostTransfer

IDLE_WAIT_S = 0.02  # how long an otherwise idle scheduler waits for a compile before it looks at its sockets


@dataclass
class _Pending:
    req: Req
    future: Future[CompiledGrammar]
    since: float = field(default_factory=time.monotonic)


class GrammarQueue:
    def __init__(
        self,
        backend: type[GrammarBackend] | None,
        load_tokenizer: Callable[[], GrammarTokenizer],
        compile_timeout: float,
        vocab_size: int,
        transfer: HostTransfer,
        group: TPGroup,
    ):
        self.compiler = None if backend is None else GrammarCompiler(backend, load_tokenizer)
        self.compile_timeout, self.vocab_size, self.transfer, self.group = compile_timeout, vocab_size, transfer, group
        self._pending: dict[str, _Pending] = {}
        self.active = 0  # requests holding a matcher

    @classmethod
    def for_model(cls, args: ServerArgs, model_path: str, runner: ModelRunner, eos_ids: Iterable[int]) -> GrammarQueue:
        """The queue of a scheduler serving ``model_path``: ``--grammar-backend`` (a
        PluginError if it cannot load), the model's tokenizer loaded at the first compile."""
        backend = runner.registry.grammar_backend(args.grammar_backend)
        load = tokenizer_loader(args.tokenizer_path or model_path, runner.vocab_size, eos_ids)
        timeout = args.grammar_compile_timeout
        return cls(backend, load, timeout, runner.vocab_size, runner.transfer, runner.group)

    @property
    def backend_name(self) -> str | None:
        return None if self.compiler is None else self.compiler.name

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def compiling(self) -> list[Req]:
        """The requests waiting for their grammar (they count as queued)."""
        return [p.req for p in self._pending.values()]

    def append(self, req: Req) -> None:
        """Start compiling ``req``'s grammar (the intake refused it if structured output is off)."""
        spec = req.sampling_params.grammar
        assert spec is not None and self.compiler is not None
        self._pending[req.rid] = _Pending(req, self.compiler.submit(spec))

    def poll(self, idle: bool, ready: Callable[[Req], None], refused: Callable[[Req, FinishReason], None]) -> None:
        """Hand on the requests whose compile is settled: to ``ready`` with their matcher
        set, or to ``refused`` with the 400 that ends them. ``idle``: the scheduler has
        nothing else to do, so wait briefly for a compile rather than spin."""
        if not self._pending:
            return
        verdicts = self.group.broadcast(self._verdicts(idle) if self.group.is_leader else {})
        for rid, timed_out in verdicts.items():
            req, refusal = self._settle(self._pending.pop(rid), timed_out)
            if refusal is None:
                ready(req)
            else:
                refused(req, refusal)

    def _verdicts(self, idle: bool) -> dict[str, bool]:
        """Rank 0's decision: settled rid -> whether it timed out."""
        if idle:
            wait([p.future for p in self._pending.values()], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        now = time.monotonic()
        return {
            rid: not p.future.done()
            for rid, p in self._pending.items()
            if p.future.done() or now - p.since > self.compile_timeout
        }

    def _settle(self, pending: _Pending, timed_out: bool) -> tuple[Req, FinishReason | None]:
        req = pending.req
        spec = req.sampling_params.grammar
        assert spec is not None
        name = spec.source or spec.kind
        if timed_out:
            limit = f"{self.compile_timeout:g}"
            return req, _bad_request(
                f"{name}: compiling the grammar took longer than --grammar-compile-timeout ({limit} s)"
            )
        try:
            matcher = pending.future.result().matcher()  # other ranks may wait here for their own compile
            gate = req.sampling_params.grammar_gate
            req.grammar = matcher if gate is None else GatedMatcher(matcher, gate)
        except GrammarError as exc:
            return req, _bad_request(f"{name}: invalid {spec.kind.replace('_', ' ')}: {exc}")
        except Exception as exc:  # the backend itself failed (its build, say): not the request's fault
            return req, FinishReason(type="abort", message=f"grammar backend failed: {exc}", status_code=500)
        self.active += 1
        return req, None

    def drop(self, req: Req) -> None:
        """A finished or aborted request leaves: out of the queue, its matcher released."""
        self._pending.pop(req.rid, None)
        if req.grammar is not None:
            req.grammar = None
            self.active -= 1

    def constrains(self, reqs: list[Req]) -> bool:
        return self.active > 0 and any(r.grammar is not None for r in reqs)

    def step_mask(self, reqs: list[Req]) -> TokenMask | None:
        """The bitmask of the constrained requests among ``reqs`` (a step's sampled
        rows, in order) on the device; None when none is constrained."""
        if not self.active:
            return None
        constrained = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None]
        if not constrained:
            return None
        rows = [i for i, _ in constrained]
        bitmask = allocate_token_bitmask(len(rows), self.vocab_size, pin_memory=self.transfer.pinned_staging)
        for j, (_, grammar) in enumerate(constrained):
            grammar.fill_bitmask(bitmask, j)
        return TokenMask(bitmask.to(self.transfer.device, non_blocking=True), self.transfer.to_device(rows))

    @staticmethod
    def allowed_prefix(req: Req, proposals: list[int]) -> list[int]:
        """The longest prefix of ``proposals`` (speculative decoding) that ``req``'s grammar
        accepts after its tokens so far, stopping before a token that would complete the
        grammar; its matcher is left where it was."""
        grammar = req.grammar
        if grammar is None:
            return proposals
        taken = 0
        for token in proposals:
            if not grammar.accept_token(token):
                break
            taken += 1
            if grammar.is_terminated():
                taken -= 1
                grammar.rollback(1)
                break
        if taken:
            grammar.rollback(taken)
        return proposals[:taken]

    def verify_mask(self, reqs: list[Req], proposals: list[list[int]]) -> TokenMask | None:
        """A verify step's bitmask: a constrained request's row ``j`` allows what its
        grammar allows after its first ``j`` proposals (``allowed_prefix``'s, so each is
        accepted; the matcher is rolled back after); None when none is constrained."""
        if not self.constrains(reqs):
            return None
        rows: list[int] = []
        first = 0
        for req, drafts in zip(reqs, proposals, strict=True):
            if req.grammar is not None:
                rows.extend(range(first, first + len(drafts) + 1))
            first += len(drafts) + 1
        bitmask = allocate_token_bitmask(len(rows), self.vocab_size, pin_memory=self.transfer.pinned_staging)
        filled = 0
        for req, drafts in zip(reqs, proposals, strict=True):
            grammar = req.grammar
            if grammar is None:
                continue
            for j in range(len(drafts) + 1):
                grammar.fill_bitmask(bitmask, filled)
                filled += 1
                if j < len(drafts) and not grammar.accept_token(drafts[j]):
                    raise ValueError(f"the grammar rejected proposal {drafts[j]} it had accepted")
            if drafts:
                grammar.rollback(len(drafts))
        return TokenMask(bitmask.to(self.transfer.device, non_blocking=True), self.transfer.to_device(rows))

    @staticmethod
    def accept(req: Req, token: int, reason: FinishReason | None) -> FinishReason | None:
        """Advance ``req``'s matcher by its new token; ``reason`` is the stop check's
        verdict. A terminated grammar finishes the request ("stop")."""
        if req.grammar is None:
            return reason
        if not req.grammar.accept_token(token):
            raise ValueError(f"the grammar rejected token {token}")  # the mask allowed it: a backend bug
        if reason is None and req.grammar.is_terminated():
            return FinishReason(type="stop")
        return reason


def tokenizer_loader(path: str, vocab_size: int, eos_ids: Iterable[int]) -> Callable[[], GrammarTokenizer]:
    """Loads the tokenizer in a compile thread, an instance of its own: the scheduler
    may decode with another meanwhile (stop strings), and HF tokenizers are not
    meant to be shared across threads."""
    eos = tuple(sorted(eos_ids))

    def load() -> GrammarTokenizer:
        from transformers import AutoTokenizer

        return GrammarTokenizer(AutoTokenizer.from_pretrained(path), vocab_size, eos)

    return load


def _bad_request(message: str) -> FinishReason:
    return FinishReason(type="abort", message=message, status_code=400)
