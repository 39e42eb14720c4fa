"""Logprobs in the OpenAI shapes, from the runtime's ``(logprob, token_id)`` pairs.

A token's ``bytes`` are its exact UTF-8 bytes, which for byte-level BPE may be
part of a character; its ``token`` text is those bytes decoded with
replacement characters, so it is readable but not always exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from radixserve.server.response_models import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

Pair = tuple[float, int]  # (logprob, token id)
PromptPair = tuple[float | None, int]  # the first prompt token has no logprob


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-character map used by byte-level BPE."""
    byte_values = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    code_points = byte_values[:]  # printable bytes stand for themselves
    shifted = 0
    for b in range(256):
        if b not in byte_values:  # the others map to 256, 257, ...
            byte_values.append(b)
            code_points.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(byte_values, code_points, strict=True)}


class TokenTexts:
    """Text and bytes of single tokens, cached."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._bytes_of = lru_cache(maxsize=1 << 16)(self._compute_bytes)
        self._byte_map = _byte_decoder() if _is_byte_level(tokenizer) else None

    def _compute_bytes(self, token_id: int) -> bytes:
        if self._byte_map is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and all(ch in self._byte_map for ch in piece):
                return bytes(self._byte_map[ch] for ch in piece)
        text: str = self.tokenizer.decode([token_id])
        return text.encode()

    def bytes(self, token_id: int) -> bytes:
        return self._bytes_of(token_id)

    def text(self, token_id: int) -> str:
        return self._bytes_of(token_id).decode("utf-8", errors="replace")


def _is_byte_level(tokenizer: Any) -> bool:
    try:
        from tokenizers import decoders

        return isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
    except (AttributeError, ImportError):
        return False


def chat_logprobs(texts: TokenTexts, tokens: Sequence[Pair], tops: Sequence[Sequence[Pair]]) -> ChatLogprobs:
    def entry(pair: Pair) -> TopLogprob:
        logprob, token_id = pair
        return TopLogprob(token=texts.text(token_id), logprob=logprob, bytes=list(texts.bytes(token_id)))

    content = []
    for i, pair in enumerate(tokens):
        top = tops[i] if i < len(tops) else []
        content.append(ChatTokenLogprob(**entry(pair).model_dump(), top_logprobs=[entry(t) for t in top]))
    return ChatLogprobs(content=content)


def completion_logprobs(
    texts: TokenTexts, tokens: Sequence[PromptPair], tops: Sequence[Sequence[Pair] | None], text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy shape; ``text_offset`` is where the first token starts in the
    choice's text. Returns the logprobs and the offset after the last token.
    As in OpenAI's API, each ``top_logprobs`` entry also holds the chosen token."""
    out = CompletionLogprobs()
    for i, (logprob, token_id) in enumerate(tokens):
        text = texts.text(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        top = tops[i] if i < len(tops) else []
        if logprob is None:  # the first prompt token: nothing to compare with
            out.top_logprobs.append(None)
        else:
            alternatives = {texts.text(t): lp for lp, t in top or []}
            alternatives.setdefault(text, logprob)
            out.top_logprobs.append(alternatives)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out, text_offset
