"""Whether a request can ever be served: one rule for the front door (the
TokenizerManager, which answers 400) and the scheduler (which guards itself)."""

from __future__ import annotations

from typing import Optional


def request_fit_error(prompt_len: int, max_new_tokens: int, context_length: int, kv_pool_tokens: int,
                      page_size: int, prompt_field: str = "input_ids") -> Optional[str]:
    """A message naming the field at fault, or None when the request fits."""
    if prompt_len == 0:
        return f"{prompt_field}: the prompt is empty"
    if prompt_len >= context_length:
        return f"{prompt_field}: the prompt has {prompt_len} tokens; the context length is {context_length}"
    if prompt_len + max_new_tokens > context_length:
        return (f"max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the context length {context_length}")
    # Whole pages of KV for every token; more than the pool could never finish.
    needed = -(-(prompt_len + max_new_tokens) // page_size) * page_size
    if needed > kv_pool_tokens:
        name = prompt_field if prompt_len + 1 > kv_pool_tokens else "max_new_tokens"
        return (f"{name}: prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) needs {needed} KV "
                f"cache slots; the pool holds {kv_pool_tokens}")
    return None
