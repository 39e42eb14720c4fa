"""What one request may be: text that every tokenizer takes, the operator's
bounds on its sampling parameters, and whether it can ever be served (one rule
for the front door, the TokenizerManager, which answers 400, and the
scheduler, which guards itself)."""

from __future__ import annotations

import re
from typing import Any, Protocol

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """JSON can carry a lone UTF-16 surrogate (``"\\udc00"``) that no tokenizer or
    UTF-8 encoder accepts; such text is refused before it goes any further."""
    return not text.isascii() and _LONE_SURROGATE.search(text) is not None


class SamplingLimits(Protocol):
    """Bounds on one request's sampling parameters; ``ServerArgs`` has them as
    flags (``--max-n``, ``--max-stop-strings``, ``--max-stop-chars``).

    Every choice of ``n`` is a request in the scheduler, and every stop string
    is matched against the text after each token, so both cost the whole
    server, not just the request that asks for them. The defaults (64 choices;
    64 stop strings of 8192 characters in all) are far above what clients use
    (OpenAI allows 4 stop strings) and keep the matching after each token to a
    few KiB of text."""

    max_n: int
    max_stop_strings: int
    max_stop_chars: int


def token_ids_error(ids: list[Any], vocab_size: int, field: str = "input_ids") -> str | None:
    """A message naming ``field`` unless every id is an integer (not a bool) in the vocabulary."""
    if any(type(t) is not int or not 0 <= t < vocab_size for t in ids):
        return f"{field}: every id must be an integer in [0, {vocab_size})"
    return None


def request_fit_error(
    prompt_len: int,
    max_new_tokens: int,
    context_length: int,
    kv_pool_tokens: int,
    page_size: int,
    prompt_field: str = "input_ids",
) -> str | None:
    """A message naming the field at fault, or None when the request fits."""
    if prompt_len == 0:
        return f"{prompt_field}: the prompt is empty"
    # A request that generates needs room for a token after its prompt; a prefill alone (an embedding) does not.
    if prompt_len > context_length - (1 if max_new_tokens > 0 else 0):
        return f"{prompt_field}: the prompt has {prompt_len} tokens; the context length is {context_length}"
    if prompt_len + max_new_tokens > context_length:
        return (
            f"max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"the context length {context_length}"
        )
    # Whole pages of KV for every token; more than the pool could never finish.
    needed = -(-(prompt_len + max_new_tokens) // page_size) * page_size
    if needed > kv_pool_tokens:
        name = prompt_field if prompt_len + 1 > kv_pool_tokens else "max_new_tokens"
        return (
            f"{name}: prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) needs {needed} KV "
            f"cache slots; the pool holds {kv_pool_tokens}"
        )
    return None
