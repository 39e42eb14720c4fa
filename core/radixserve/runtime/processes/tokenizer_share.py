"""One tokenizer load per server: the first scheduler rank loads it
(``AutoTokenizer``) and sends it, pickled, with its ready message; the server
(or Engine) and the detokenizer unpickle that copy.

``AutoTokenizer`` imports torch and the model's configuration classes: seconds
of CPU that the server and the detokenizer would otherwise spend again while
the scheduler is loading the model, on the same cores. Unpickling imports only
the tokenizer's own class.
"""

from __future__ import annotations

from radixserve.startup_gc import gc_paused


def import_tokenizer_modules() -> None:
    """Import most of what unpickling a tokenizer imports (transformers'
    tokenizer base), so that a process can do it while the scheduler loads the
    model, before the tokenizer arrives."""
    with gc_paused():
        import transformers.tokenization_utils_base  # noqa: F401
