"""The detokenizer process: token batches in, UTF-8-complete text deltas out.

Stop strings: while a request runs, the last ``max(len(stop)) - 1`` characters
are held back so a stop string is never partly streamed before it matches; at
the finish the text is cut before the matched stop string (unless
``no_stop_trim``), and a matched stop token id is left out of the text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from radixserve.ipc import Endpoints, die_with_parent, pull_socket, push_socket
from radixserve.logging_utils import configure_logging
from radixserve.messages import TextBatch, TextOutput, TokenBatch, TokenOutput
from radixserve.server.incremental_detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclass
class _RequestText:
    decoder: IncrementalDetokenizer
    text: str = ""  # all text decoded so far
    sent: int = 0  # characters already sent
    pending_ids: list[int] = field(default_factory=list)


class DetokenizerState:
    """Per-request incremental decoding; usable without the process (tests)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestText] = {}

    def handle(self, out: TokenOutput) -> TextOutput:
        state = self.requests.get(out.rid)
        if state is None:
            decoder = IncrementalDetokenizer(self.tokenizer, out.skip_special_tokens, out.spaces_between_special_tokens)
            state = self.requests[out.rid] = _RequestText(decoder)
        finish = out.finish_reason
        ids = out.new_token_ids
        if finish is not None and isinstance(finish.get("matched"), int) and ids and ids[-1] == finish["matched"]:
            ids = ids[:-1]  # the matched stop token is not part of the text
        state.text += state.decoder.push(ids)
        if finish is None:
            holdback = max((len(s) for s in out.stop_strings), default=1) - 1
            end = max(len(state.text) - holdback, state.sent)
        else:
            state.text += state.decoder.finish()
            matched = finish.get("matched")
            if isinstance(matched, str) and not out.no_stop_trim:
                cut = state.text.find(matched, 0)
                if cut >= 0:
                    state.text = state.text[:cut]
            end = len(state.text)
            del self.requests[out.rid]
        new_text = state.text[state.sent : end]
        state.sent = max(end, state.sent)
        return TextOutput(token=out, new_text=new_text)


def run_detokenizer_process(tokenizer_path: str, endpoints: Endpoints, log_level: str = "info") -> None:
    die_with_parent()
    configure_logging(log_level, prefix="detokenizer")
    from transformers import AutoTokenizer

    state = DetokenizerState(AutoTokenizer.from_pretrained(tokenizer_path))
    ctx = zmq.Context()
    recv = pull_socket(ctx, endpoints.detokenizer)
    send = push_socket(ctx, endpoints.tokenizer_manager)
    while True:
        batch: TokenBatch = recv.recv_pyobj()
        send.send_pyobj(TextBatch([state.handle(out) for out in batch.outputs]))
