"""What the scheduler sends about a request, and when: its new tokens, logprobs
and finish, assembled from the request's state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

from radixserve.messages import DetokenizeSettings, TokenOutput
from radixserve.runtime.execution.request import Req

logger = logging.getLogger(__name__)


class Outbox:
    """Requests with something to send. Streams send every ``stream_interval``
    tokens; the others send their first token (so time to first token is known)
    and then the rest at the finish."""

    def __init__(self, stream_interval: int):
        self.stream_interval = stream_interval
        self._touched: dict[str, Req] = {}

    def touch(self, req: Req) -> None:
        self._touched[req.rid] = req

    def collect(self, on_error: Callable[[Req, Exception], None]) -> list[TokenOutput]:
        """The messages due now. A request whose message cannot be assembled goes to
        ``on_error`` (which must finish it) and sends an error instead."""
        outputs = []
        for rid, req in list(self._touched.items()):
            new = len(req.output_ids) - req.sent_len
            first = req.sent_len == 0 and new > 0
            if not req.finished and not first and (not req.stream or new < self.stream_interval):
                continue
            try:
                outputs.append(make_output(req))
            except Exception as exc:
                logger.exception("assembling the output of %s failed", rid)
                on_error(req, exc)
                outputs.append(error_output(req))
            del self._touched[rid]
        return outputs


def make_output(req: Req) -> TokenOutput:
    """A request's tokens (and logprobs) since its last message; the first message
    also carries how to detokenize it."""
    start = req.sent_len
    params = req.sampling_params
    out = TokenOutput(
        rid=req.rid,
        new_token_ids=req.output_ids[start:],
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=max(req.cached_tokens, 0),
        queue_time=req.queue_time,
        stream=req.stream,
        embedding=req.embedding,
    )
    if not req.detokenize_sent:  # once per request: the detokenizer keeps them
        out.detokenize = DetokenizeSettings(
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop_strings=tuple(params.stop or ()),
            no_stop_trim=params.no_stop_trim,
        )
        req.detokenize_sent = True
    if req.return_logprob:
        out.output_token_logprobs = req.output_token_logprobs[start:]
        out.output_top_logprobs = req.output_top_logprobs[start:]
        if req.input_token_logprobs is not None and start == 0:
            out.input_token_logprobs = req.input_token_logprobs
            out.input_top_logprobs = req.input_top_logprobs
    req.sent_len = len(req.output_ids)
    return out


def error_output(req: Req) -> TokenOutput:
    """The last message of a request (``finish_reason`` set) whose output could
    not be assembled: no tokens or logprobs, just the finish."""
    out = TokenOutput(
        rid=req.rid,
        new_token_ids=[],
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
    )
    if not req.detokenize_sent:
        out.detokenize = DetokenizeSettings()
    req.sent_len = len(req.output_ids)
    return out


def add_input_logprobs(req: Req, values: list[float], tops: list[list[tuple[float, int]]], targets: list[int]) -> None:
    """Append one step's prompt logprobs (of ``targets``) to the request's."""
    if req.input_token_logprobs is None:
        req.input_token_logprobs, req.input_top_logprobs = [], []
        if req.logprob_start_len == 0:
            # The first prompt token has nothing before it to be scored against.
            req.input_token_logprobs.append((None, req.origin_input_ids[0]))
            req.input_top_logprobs.append(None)
    req.input_token_logprobs.extend(zip(values, targets, strict=True))
    top_logprobs = cast("list[list[tuple[float, int]] | None]", req.input_top_logprobs)  # set with the values
    top_logprobs.extend(tops)
