"""How many leading token ids two sequences share: the one comparison the queue's
token counts and the draft models' catch-up both make."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (at most ``limit``),
    by bisection over slice comparisons, each done in C: a Python loop over a few
    thousand equal ids would cost more than the step it serves."""
    a = a if isinstance(a, list) else list(a)  # a list's slice equals only a list's
    b = b if isinstance(b, list) else list(b)
    low, high = 0, min(len(a), len(b), len(a) if limit is None else limit)
    if a[:high] == b[:high]:  # the common case: one comparison
        return high
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low
