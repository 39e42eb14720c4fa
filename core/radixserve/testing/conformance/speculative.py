"""The proposer kit: ``check_proposer(proposer)`` checks a speculative proposer
(radixserve.speculative.base) against the contract the scheduler relies on:

- ``bounds``: for every request, at most ``max_tokens`` non-negative integer ids
  (none when ``max_tokens`` is 0), one list per request, in order;
- ``alone-or-batched``: a request gets the same proposal alone, in a batch, in a
  batch in another order, and from a second instance given the same tokens. Every
  tensor-parallel rank runs its own proposer on the same requests, and a seeded
  request's tokens must not depend on what else runs, so proposals must be
  deterministic and per request;
- ``grown-step-by-step``: a request asked after each step of a run (its tokens
  growing by some of what was proposed and one token more, as after a verify
  step) gets what a fresh instance proposes for the same tokens at once: whatever
  the proposer keeps between steps follows the tokens;
- ``forget``: after ``forget(rid)`` a new request reusing the id is a new request.

Whether proposals are any good is a benchmark's question, not the kit's: a
proposer can never change a request's tokens, only the speed (the verifier keeps
only what the model agrees with)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from radixserve.speculative.base import DraftRequest, Proposer, ProposerSettings
from radixserve.testing.conformance.base import (
    BackendSpec,
    CaseResult,
    ConformanceReport,
    _error_text,
    resolve_backend,
)

if TYPE_CHECKING:
    from radixserve.registry import PluginRegistry

VOCAB = 50  # small, so that sequences repeat and n-gram-like proposers propose


def _sequences(seed: int, count: int = 6) -> list[list[int]]:
    """Token sequences with repeats (a pattern cycled with noise), of ragged lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pattern = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))]
        seq = [t if rng.random() > 0.15 else rng.randrange(VOCAB) for t in (pattern * 12)[: rng.randint(3, 90)]]
        out.append(seq)
    return out


def _bounds(make: Callable[[], Proposer], settings: ProposerSettings) -> str | None:
    proposer = make()
    requests = [
        DraftRequest(f"b{i}", seq, i % (settings.num_draft_tokens + 1)) for i, seq in enumerate(_sequences(1, 12))
    ]
    got = proposer.propose(requests)
    if not isinstance(got, list) or len(got) != len(requests):
        return f"{len(requests)} requests, {len(got) if isinstance(got, list) else type(got).__name__} proposals"
    for req, tokens in zip(requests, got, strict=True):
        if not isinstance(tokens, list) or len(tokens) > req.max_tokens:
            return f"{req.rid} (max_tokens {req.max_tokens}) was proposed {tokens!r}"
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in tokens):
            return f"{req.rid} was proposed ids that are not non-negative ints: {tokens!r}"
    return None


def _alone_or_batched(make: Callable[[], Proposer], settings: ProposerSettings) -> str | None:
    requests = [DraftRequest(f"a{i}", seq, settings.num_draft_tokens) for i, seq in enumerate(_sequences(2))]
    batched = make().propose(requests)
    reverse = make().propose(requests[::-1])[::-1]
    for i, req in enumerate(requests):
        alone = make().propose([req])[0]
        if not alone == batched[i] == reverse[i]:
            return f"{req.rid}: alone {alone}, in a batch {batched[i]}, in a reversed batch {reverse[i]}"
    again = make().propose(requests)
    if again != batched:
        return f"a second instance proposed {again} where the first proposed {batched}"
    return None


def _grown_step_by_step(make: Callable[[], Proposer], settings: ProposerSettings) -> str | None:
    rng = random.Random(3)
    proposer = make()
    tokens = [list(seq[: max(2, len(seq) // 3)]) for seq in _sequences(3, 4)]
    for step in range(12):
        requests = [DraftRequest(f"g{i}", list(seq), settings.num_draft_tokens) for i, seq in enumerate(tokens)]
        got = proposer.propose(requests)
        fresh = make().propose(requests)
        if got != fresh:
            return f"step {step}: proposed {got}, a fresh instance given the same tokens {fresh}"
        for seq, proposal in zip(tokens, got, strict=True):
            seq += proposal[: rng.randint(0, len(proposal))] + [rng.randrange(VOCAB)]
    return None


def _forget(make: Callable[[], Proposer], settings: ProposerSettings) -> str | None:
    first, second = _sequences(4, 2)
    proposer = make()
    proposer.propose([DraftRequest("f", first, settings.num_draft_tokens)])
    proposer.forget("f")
    got = proposer.propose([DraftRequest("f", second, settings.num_draft_tokens)])
    fresh = make().propose([DraftRequest("f", second, settings.num_draft_tokens)])
    return None if got == fresh else f"after forget, proposed {got} where a fresh instance proposes {fresh}"


CASES: dict[str, Callable[[Callable[[], Proposer], ProposerSettings], str | None]] = {
    "bounds": _bounds,
    "alone-or-batched": _alone_or_batched,
    "grown-step-by-step": _grown_step_by_step,
    "forget": _forget,
}


def check_proposer(
    proposer: BackendSpec,
    settings: ProposerSettings | None = None,
    registry: PluginRegistry | None = None,
    cases: Sequence[str] = tuple(CASES),
) -> ConformanceReport:
    """Run the contract's cases on ``proposer`` (a registered name or the class),
    built with ``settings`` (default: the flags' defaults)."""
    settings = settings or ProposerSettings()
    name, cls = resolve_backend("speculative", proposer, registry)
    report = ConformanceReport(kind="speculative", backend=name, reference="the proposer contract", device="cpu")

    def make() -> Proposer:
        built: Proposer = cls(settings)
        return built

    for case in cases:
        try:
            problem = CASES[case](make, settings)
        except Exception as exc:
            problem = _error_text(exc)
        report.results.append(CaseResult(case=case, dtype="-", passed=problem is None, error=problem))
    return report
