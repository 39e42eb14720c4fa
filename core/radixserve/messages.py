"""Typed messages between the processes (pickled over ZMQ).

    TokenizerManager --GenerateRequest/AbortRequest/ControlRequest--> Scheduler
    Scheduler --TokenBatch--> Detokenizer --TextBatch--> TokenizerManager
    Scheduler --ControlReply--> TokenizerManager

server/ and runtime/ both import this; neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from radixserve.sampling.params import SamplingParams


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # First prompt position whose logprob is returned; -1: none of the prompt.
    logprob_start_len: int = -1
    stream: bool = False
    priority: int = 0


@dataclass
class AbortRequest:
    rid: str  # "" aborts everything


@dataclass
class ControlRequest:
    """A request/response call to the scheduler: ``kind`` is one of
    ``server_info``, ``flush_cache``, ``health``."""

    kind: str
    call_id: int = 0


@dataclass
class ControlReply:
    kind: str
    call_id: int
    payload: Any = None


@dataclass
class TokenOutput:
    """New output of one request since the last message about it."""

    rid: str
    new_token_ids: list[int]
    finish_reason: Optional[dict] = None  # {"type": stop|length|abort, "matched": ..., "message": ...}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Logprobs, present when requested: one (logprob, token_id) per new token,
    # top alternatives as lists of (logprob, token_id).
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Prompt logprobs from logprob_start_len, sent once with the first output;
    # the first prompt token's logprob is None.
    input_token_logprobs: Optional[list[tuple[Optional[float], int]]] = None
    input_top_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    # Detokenization settings, carried so the detokenizer keeps no per-request config.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_strings: tuple[str, ...] = ()
    no_stop_trim: bool = False
    stream: bool = False


@dataclass
class TokenBatch:
    outputs: list[TokenOutput]


@dataclass
class TextOutput:
    """A ``TokenOutput`` plus its new text (UTF-8 complete, stop strings trimmed)."""

    token: TokenOutput
    new_text: str


@dataclass
class TextBatch:
    outputs: list[TextOutput]
