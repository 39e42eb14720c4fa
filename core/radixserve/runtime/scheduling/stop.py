"""When a request is finished, and what its final text leaves out.

The scheduler asks ``StopChecker.check`` after every token it appends. The text
side (the detokenizer) uses ``drop_stop_token``, ``StopHoldback`` and
``trim_stop_string`` so that a stop string or stop token the user did not ask to
see (``no_stop_trim``) is never streamed, not even in part.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Sequence
from typing import Any, cast

from radixserve.messages import FinishReason
from radixserve.sampling.params import SamplingParams


class StopChecker:
    """Finish conditions of a request, checked after each appended token.

    In order: the last token is a stop token (``stop_token_ids``, or an EOS id
    unless ``ignore_eos``); a stop string completed with the last token; the
    ``max_new_tokens`` budget is used up. Before ``min_new_tokens`` tokens
    exist, only the budget counts (and ``min_new_tokens <= max_new_tokens``).

    Stop strings are looked for in the decoded tail of the output: a window of
    tokens long enough to hold the longest stop string, so a step costs the
    same however long the output is. An occurrence counts only if it ends in
    the last token's text, so one completed before ``min_new_tokens`` is not
    found later.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer  # a HF tokenizer; None is fine without stop strings
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(self, params: SamplingParams, output_ids: Sequence[int]) -> FinishReason | None:
        n = len(output_ids)
        if n and n >= params.min_new_tokens:
            last = output_ids[-1]
            if last in cast("Sequence[int]", params.stop_token_ids) or (
                not params.ignore_eos and last in self.eos_token_ids
            ):
                return FinishReason("stop", last)
            if params.stop:
                matched = self._stop_string(params, output_ids)
                if matched is not None:
                    return FinishReason("stop", matched)
        if n >= params.max_new_tokens:
            return FinishReason("length")
        return None

    def _stop_string(self, params: SamplingParams, output_ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        # Each token carries at least one byte of text (special tokens aside), so
        # this many tokens cover the longest stop string plus a token straddling
        # its start and one whose own decoding may be cut short at the window edge.
        stops = cast("Sequence[str]", params.stop)  # a list once the params are constructed
        window = list(output_ids[-(max(len(s.encode()) for s in stops) + 2) :])
        tail = self._decode(window, params)
        if not any(s in tail for s in stops):
            return None
        new_from = len(os.path.commonprefix([self._decode(window[:-1], params), tail]))
        best: str | None = None
        best_end = 0
        for s in stops:
            start = tail.find(s, max(new_from - len(s) + 1, 0))
            if start >= 0 and (best is None or start + len(s) < best_end):
                best, best_end = s, start + len(s)
        return best

    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        text: str = self.tokenizer.decode(
            ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        return text


def internal_error(exc: Exception) -> FinishReason:
    """A request ended by a failure that is not its fault (a 500)."""
    return FinishReason(type="abort", message=f"internal error: {type(exc).__name__}: {exc}", status_code=500)


def out_of_memory() -> FinishReason:
    """A request that cannot go on even alone in the KV pool."""
    return FinishReason(type="abort", matched=None, message="out of KV cache memory for a single request")


def drop_stop_token(ids: list[int], matched: int | str | None, no_stop_trim: bool) -> list[int]:
    """The ids whose text the user sees, from a finished request's last ids:
    a matched stop/EOS token (``matched`` an int) is left out unless ``no_stop_trim``."""
    if no_stop_trim or not isinstance(matched, int) or not ids or ids[-1] != matched:
        return ids
    return ids[:-1]


class StopHoldback:
    """How many trailing characters of a running request's text not to stream
    yet: the longest suffix that is a proper prefix of some stop string, since
    the next token may complete it.

    The stop strings are sorted once per request; the strings that start with a
    given text are then contiguous, beginning where that text would be inserted.
    So each candidate suffix costs one binary search, and a call costs
    O(longest stop string x log(number of stop strings)) whatever their number.
    """

    def __init__(self, stop_strings: tuple[str, ...]):
        self.sorted = sorted(set(stop_strings))
        self.longest = max(map(len, self.sorted), default=0)

    def __call__(self, text: str) -> int:
        for n in range(min(self.longest - 1, len(text)), 0, -1):
            suffix = text[-n:]
            i = bisect.bisect_left(self.sorted, suffix)
            if i < len(self.sorted) and self.sorted[i] == suffix:
                i += 1  # equal is not a proper prefix; a longer string may follow
            if i < len(self.sorted) and self.sorted[i].startswith(suffix):
                return n
        return 0


def trim_stop_string(text: str, matched: int | str | None, no_stop_trim: bool, start: int = 0) -> str:
    """A finished request's text, cut before the stop string ``matched`` (unless
    ``no_stop_trim``): at its first occurrence from ``start``. Pass as ``start``
    the length of text already streamed under ``StopHoldback``: the matched
    occurrence cannot begin before it, while an earlier one (completed before
    ``min_new_tokens``) can."""
    if no_stop_trim or not isinstance(matched, str):
        return text
    cut = text.find(matched, start)
    return text if cut < 0 else text[:cut]
