"""Start-up with the cyclic garbage collector paused.

Importing torch and transformers creates hundreds of thousands of long-lived
objects (modules, classes, functions), and each collection that the
allocations trigger walks them again: about a fifth of the CPU a process spends
importing them and loading a tokenizer (measured: 2.1-2.3 s with collections,
1.8 s without). Start-up makes little cyclic garbage, so the server, the
scheduler and the detokenizer pause the collector while they start and resume
it before they serve.

Resuming it is not free either: the first collection after start-up walks
everything imported (0.2-0.3 s of the server's CPU, measured with py-spy).
A process that starts once and serves until it exits freezes what start-up
made (``gc.freeze``: the objects alive then are never walked again) before it
resumes the collector; a library caller (the Engine in a user's process) does
not, since its older garbage would then never be freed.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused(freeze: bool = False) -> Iterator[None]:
    """No cyclic collection inside; the collector as it was after. ``freeze``:
    when the block succeeds, what is alive then is frozen (for a serving
    process's start-up only)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            gc.freeze()
    finally:
        if enabled:
            gc.enable()
