"""The detokenizer process: token batches in, UTF-8-complete text deltas out.

Stop strings: while a request runs, a trailing prefix of any stop string is
held back so a stop string is never partly streamed before it matches; at the
finish the text is cut before the matched stop string and a matched stop token
is left out of the text (both unless ``no_stop_trim``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq

from radixserve.ipc import Endpoints, die_with_parent, pull_socket, push_socket
from radixserve.logging_utils import configure_logging
from radixserve.messages import TextBatch, TextOutput, TokenBatch, TokenOutput
from radixserve.runtime.stop import drop_stop_token, stop_holdback, trim_stop_string
from radixserve.server.incremental_detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclass
class _RequestText:
    decoder: IncrementalDetokenizer
    text: str = ""  # all text decoded so far
    sent: int = 0  # characters already sent


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
        if finish is None:
            state.text += state.decoder.push(out.new_token_ids)
            end = max(len(state.text) - stop_holdback(state.text, out.stop_strings), state.sent)
        else:
            matched = finish.get("matched")
            state.text += state.decoder.push(drop_stop_token(out.new_token_ids, matched, out.no_stop_trim))
            state.text += state.decoder.finish()
            state.text = trim_stop_string(state.text, matched, out.no_stop_trim, start=state.sent)
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
