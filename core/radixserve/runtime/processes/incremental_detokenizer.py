"""Streaming one request's output ids into text, a few tokens at a time.

Decoding the new tokens alone is wrong in two ways: a byte-level BPE token can
hold part of a character's UTF-8 bytes (it decodes to U+FFFD until the rest
arrives), and some decoders treat the first token of a sequence specially
(SentencePiece drops its leading space). So each push decodes a short window
that starts at the tokens emitted by the previous push (the *prefix*), and
emits what the new tokens add to the prefix's text. Text ending in U+FFFD is
held back until a later token completes the character, or until ``finish``.
SentencePiece byte fallback decodes a run of byte tokens (``<0xE4>``) as one:
if any byte of the run is invalid UTF-8, every byte of it becomes U+FFFD, so
a run's text is final only once a token that is not a byte ends it (a special
token that decoding skips does not).

All pushes plus ``finish`` concatenate to ``tokenizer.decode(all_ids)``, while
each push decodes only the window, not the whole output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer  # a HF tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._skipped_ids = frozenset(tokenizer.all_special_ids if skip_special_tokens else ())
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: the prefix, already emitted
        self.read_offset = 0  # ids[read_offset:]: not emitted yet

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now final (possibly "")."""
        self.ids.extend(new_ids)
        prefix_text, text = self._window_texts()
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR) or self._ends_in_byte_run():
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix_text) :]

    def finish(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text, text = self._window_texts()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix_text) :]

    def _ends_in_byte_run(self) -> bool:
        for token_id in reversed(self.ids):
            if token_id not in self._skipped_ids:
                token = self.tokenizer.convert_ids_to_tokens(token_id)
                return isinstance(token, str) and _BYTE_TOKEN.fullmatch(token) is not None
        return False

    def _window_texts(self) -> tuple[str, str]:
        return (
            self._decode(self.ids[self.prefix_offset : self.read_offset]),
            self._decode(self.ids[self.prefix_offset :]),
        )

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
        return text
