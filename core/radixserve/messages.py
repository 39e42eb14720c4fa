"""Typed messages between the processes (pickled over ZMQ).

    TokenizerManager --GenerateRequest/AbortRequest/ControlRequest--> Scheduler
    RuntimeProcesses.shutdown --ShutdownRequest--> Scheduler (rank 0, then every rank)
    Scheduler --TokenBatch--> Detokenizer --TextBatch--> TokenizerManager
    Scheduler --ControlReply--> TokenizerManager

With --dp-size > 1 the DP controller stands where the TokenizerManager's
scheduler was: it forwards each GenerateRequest to one replica (a scheduler
group), AbortRequest to the replica running it, ControlRequest to all (merging
their ControlReplies); replicas report finished requests to it
(ReplicaFinished) and send their TokenBatches straight to the detokenizer; the
process watcher tells it of a dead replica (ReplicaDown).

server/ and runtime/ both import this; runtime/ never imports server/, and server/
imports runtime/ only to start its processes (runtime/processes/spawn.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from radixserve.sampling.params import SamplingParams


@dataclass(frozen=True)
class Bootstrap:
    """Where a disaggregated request's KV meets its other half (SGLang's fields): the
    prefill worker's host and bootstrap port, and the request's room there."""

    host: str
    port: int
    room: int

    def for_sample(self, index: int, n: int) -> Bootstrap:
        """The room of sample ``index`` of ``n`` (``n`` > 1: each sample's KV is its own;
        both workers of the pair derive the same rooms)."""
        if n == 1:
            return self
        return Bootstrap(self.host, self.port, self.room * SAMPLE_ROOMS + index)


# Rooms per request for its samples (n > 1): more than any --max-n.
SAMPLE_ROOMS = 1 << 16


@dataclass(kw_only=True)
class RequestOptions:
    """What a request asks for besides its prompt and sampling parameters,
    declared once: the TokenizerManager's ``GenerateInput``, the
    ``GenerateRequest`` message and the scheduler's ``Req`` all extend it."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    # First prompt position whose logprob is returned; -1: none of the prompt.
    logprob_start_len: int = -1
    stream: bool = False
    # Higher is admitted first under --schedule-policy priority.
    priority: int = 0
    # An embedding request (an embedding model only): its prompt is prefilled and its
    # final hidden states pooled into ``TokenOutput.embedding``; it generates nothing.
    embed: bool = False
    # Prefill/decode disaggregation: set when a gateway pairs a prefill and a decode worker.
    bootstrap: Bootstrap | None = None
    # Multi-LoRA serving: the name of the adapter it runs under (None: the base model).
    lora_name: str | None = None

    def options(self) -> dict[str, Any]:
        """These fields as keywords, to pass them on to the next stage."""
        return {f.name: getattr(self, f.name) for f in fields(RequestOptions)}


@dataclass(kw_only=True)
class GenerateRequest(RequestOptions):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams


@dataclass(frozen=True)
class RoomRegistration:
    """A decode worker has said where a room's KV is to go: its receivers' endpoints
    and the KV heads each holds (one per tensor-parallel rank). Rank 0 of a prefill
    worker hears it on its bootstrap port and passes it to every rank with the requests."""

    room: int
    receivers: tuple[tuple[str, tuple[int, int]], ...]
    # Leading prompt tokens the decode worker has cached already: their KV is not sent.
    cached_tokens: int = 0


@dataclass
class AbortRequest:
    rid: str  # "" aborts everything


@dataclass
class ControlRequest:
    """A request/response call to the scheduler: ``kind`` is one of
    ``server_info``, ``flush_cache``, ``health``, ``start_profile`` (``args``:
    a ``ProfileOptions``), ``stop_profile``."""

    kind: str
    call_id: int = 0
    args: Any = None


# Where a profile's trace goes when nothing else says (runtime/execution/profiler.py); the
# server's --profile-dir defaults to it too.
PROFILE_DIR_ENV = "RADIXSERVE_PROFILE_DIR"


@dataclass(frozen=True)
class ProfileOptions:
    """``start_profile``'s arguments, checked on construction (a ValueError names the field).

    ``output_dir``: where the trace goes (default ``$RADIXSERVE_PROFILE_DIR``, else a
    new temporary directory); ``num_steps``: stop by itself after that many
    scheduler steps (default: at ``stop_profile``)."""

    output_dir: str | None = None
    record_shapes: bool = False
    num_steps: int | None = None

    def __post_init__(self) -> None:
        if self.output_dir is not None and (not isinstance(self.output_dir, str) or not self.output_dir):
            raise ValueError(f"output_dir: must be a non-empty string, got {self.output_dir!r}")
        if not isinstance(self.record_shapes, bool):
            raise ValueError(f"record_shapes: must be a boolean, got {self.record_shapes!r}")
        if self.num_steps is not None and (
            isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1
        ):
            raise ValueError(f"num_steps: must be a positive integer, got {self.num_steps!r}")


@dataclass
class ShutdownRequest:
    """Stop the scheduler group: rank 0 passes it to every rank with the loop's
    other messages, and each rank leaves its loop (exit code 0), on every node."""


@dataclass
class ControlReply:
    kind: str
    call_id: int
    payload: Any = None


@dataclass
class ReplicaFinished:
    """A data-parallel replica to the DP controller: the requests whose final
    ``TokenOutput`` it just sent to the detokenizer (sent only when some finished)."""

    dp_rank: int
    rids: list[str]


@dataclass
class ReplicaDown:
    """The process watcher to the DP controller: replica ``dp_rank``'s scheduler group died."""

    dp_rank: int
    reason: str


@dataclass(frozen=True)
class DetokenizeSettings:
    """How the detokenizer turns one request's tokens into text. Sent once, with
    the request's first ``TokenOutput``; the detokenizer keeps it until the finish."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_strings: tuple[str, ...] = ()
    no_stop_trim: bool = False


FinishType = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended. The one form from the scheduler to the API layers,
    which turn it into their JSON (``to_dict`` is SGLang's ``meta_info.finish_reason``)."""

    type: FinishType
    matched: int | str | None = None  # the stop token id or stop string
    message: str | None = None  # why, for aborts
    # For a request refused at the door: 400 (it can never be served) or 503 (queue full).
    status_code: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message is not None:
            d["message"] = self.message
        if self.status_code is not None:
            d["status_code"] = self.status_code
        return d


@dataclass
class TokenOutput:
    """New output of one request since the last message about it."""

    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None  # set in the request's last message
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Logprobs, present when requested: one (logprob, token_id) per new token,
    # top alternatives as lists of (logprob, token_id).
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Prompt logprobs from logprob_start_len, sent once with the first output;
    # the first prompt token's logprob is None.
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    # Set in the request's first output only (the detokenizer keeps it from there).
    detokenize: DetokenizeSettings | None = None
    # Seconds from arrival to first admission; None while the request is queued.
    queue_time: float | None = None
    stream: bool = False
    # An embedding request's embedding (pooled, normalised as the model is served), in its last message.
    embedding: list[float] | None = None


@dataclass
class TokenBatch:
    outputs: list[TokenOutput]


@dataclass
class TextOutput:
    """A ``TokenOutput`` plus its new text (UTF-8 complete, stop strings trimmed)."""

    token: TokenOutput
    new_text: str
    # Set when the detokenizer failed on this request: the request ends with this
    # error (``token.finish_reason`` stays the scheduler's: None while it still
    # runs, and the TokenizerManager then aborts it).
    error: str | None = None


@dataclass
class TextBatch:
    outputs: list[TextOutput]
