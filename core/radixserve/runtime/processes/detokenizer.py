"""The detokenizer process: token batches in, UTF-8-complete text deltas out.

A request's ``DetokenizeSettings`` (stop strings, special-token handling) come
once, with its first ``TokenOutput``; the per-request state keeps them until
the finish.

Stop strings: while a request runs, a trailing prefix of any stop string is
held back so a stop string is never partly streamed before it matches; at the
finish the text is cut before the matched stop string and a matched stop token
is left out of the text (both unless ``no_stop_trim``).

One request can never take the process down: an exception while handling its
output ends that request with an error (``TextOutput.error``) and the rest of
the batch, and later batches, are served as usual.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import zmq

from radixserve.ipc import Endpoints, die_with_parent, pull_socket, push_socket
from radixserve.logging_utils import configure_logging
from radixserve.messages import DetokenizeSettings, TextBatch, TextOutput, TokenBatch, TokenOutput
from radixserve.runtime.processes.incremental_detokenizer import IncrementalDetokenizer
from radixserve.runtime.processes.tokenizer_share import import_tokenizer_modules
from radixserve.runtime.scheduling.stop import StopHoldback, drop_stop_token, trim_stop_string
from radixserve.startup_gc import gc_paused

logger = logging.getLogger(__name__)


@dataclass
class _RequestText:
    settings: DetokenizeSettings
    decoder: IncrementalDetokenizer
    holdback: StopHoldback
    text: str = ""  # all text decoded so far
    sent: int = 0  # characters already sent


@dataclass
class DetokenizerState:
    """Per-request incremental decoding; usable without the process (tests)."""

    tokenizer: object
    requests: dict[str, _RequestText] = field(default_factory=dict)
    # Requests that failed here and still run in the scheduler: their outputs
    # are dropped until the final one, which still goes to the TokenizerManager
    # (it tracks every request until the scheduler is done with it).
    failed: set[str] = field(default_factory=set)

    def handle_batch(self, batch: TokenBatch) -> TextBatch:
        return TextBatch([text for text in map(self.handle_safely, batch.outputs) if text is not None])

    def handle_safely(self, out: TokenOutput) -> TextOutput | None:
        """``handle``, turning an exception into an error for this request only."""
        if out.rid in self.failed:
            if out.finish_reason is None:
                return None
            self.failed.discard(out.rid)
            return TextOutput(token=out, new_text="")
        try:
            return self.handle(out)
        except Exception as exc:
            logger.exception("detokenizing request %s failed; ending it with an error", out.rid)
            self.requests.pop(out.rid, None)
            if out.finish_reason is None:
                self.failed.add(out.rid)
            return TextOutput(token=out, new_text="", error=f"detokenization failed: {type(exc).__name__}: {exc}")

    def handle(self, out: TokenOutput) -> TextOutput:
        state = self.requests.get(out.rid)
        if state is None:
            state = self.requests[out.rid] = self._start(out)
        settings, finish = state.settings, out.finish_reason
        if finish is None:
            state.text += state.decoder.push(out.new_token_ids)
            end = max(len(state.text) - state.holdback(state.text), state.sent)
        else:
            matched = finish.matched
            state.text += state.decoder.push(drop_stop_token(out.new_token_ids, matched, settings.no_stop_trim))
            state.text += state.decoder.finish()
            state.text = trim_stop_string(state.text, matched, settings.no_stop_trim, start=state.sent)
            end = len(state.text)
            del self.requests[out.rid]
        new_text = state.text[state.sent : end]
        state.sent = max(end, state.sent)
        return TextOutput(token=out, new_text=new_text)

    def _start(self, out: TokenOutput) -> _RequestText:
        settings = out.detokenize
        if settings is None:
            raise ValueError(f"the first output of request {out.rid!r} carries no DetokenizeSettings")
        decoder = IncrementalDetokenizer(
            self.tokenizer, settings.skip_special_tokens, settings.spaces_between_special_tokens
        )
        return _RequestText(settings, decoder, StopHoldback(settings.stop_strings))


def run_detokenizer_process(tokenizer: Connection, endpoints: Endpoints, log_level: str = "info") -> None:
    """Serve until stopped. ``tokenizer`` brings the first scheduler rank's
    tokenizer, pickled, once the ranks are ready (``processes.wait_until_ready``);
    this process never imports torch. The pipe closing first means the runtime
    failed to start (the parent reports why): the process just ends."""
    die_with_parent()
    configure_logging(log_level, prefix="detokenizer")
    try:
        with gc_paused(freeze=True):
            import_tokenizer_modules()  # while the scheduler loads the model
            state = DetokenizerState(pickle.loads(tokenizer.recv_bytes()))
    except EOFError:
        return
    finally:
        tokenizer.close()
    ctx = zmq.Context()
    recv = pull_socket(ctx, endpoints.detokenizer)
    send = push_socket(ctx, endpoints.tokenizer_manager)
    while True:
        try:
            batch: TokenBatch = recv.recv_pyobj()
        except Exception:  # a message that does not unpickle names no request to fail
            logger.exception("dropping a message the detokenizer cannot read")
            continue
        send.send_pyobj(state.handle_batch(batch))
