"""A request as the scheduler tracks it, from queueing to completion."""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.config import PoolingMethod
from radixserve.messages import FinishReason, GenerateRequest, RequestOptions
from radixserve.sampling.params import SamplingParams
from radixserve.structured_output.backend import GrammarMatcher

_arrival = itertools.count()


def lora_namespace(adapter_id: int, rope_set: int) -> tuple[str, int, int]:
    """The cache namespace of requests under LoRA adapter load ``adapter_id``."""
    return ("lora", adapter_id, rope_set)


def is_lora_namespace(namespace: Hashable, adapter_id: int) -> bool:
    return isinstance(namespace, tuple) and namespace[:2] == ("lora", adapter_id)


@dataclass
class KVSpan:
    """A request's hold on KV memory. Its tokens (``fill_ids``) have KV slots at
    row ``row`` of the token table, the first ``kv_len`` of them (computed, or
    being computed by a launched step). The first ``num_cached`` belong to the
    prefix cache and are locked through ``last_node``; the rest are the request's
    own pages."""

    row: int
    kv_len: int
    num_cached: int
    last_node: Any
    # Slot of token kv_len - 1, kept on the host so allocation never reads the
    # device (needed only when kv_len is not page aligned; -1 otherwise).
    last_slot: int = -1


class HoldsKV(Protocol):
    """A request while it holds KV (``kv`` is set: from the ledger's ``admit`` to its
    ``release``/``discard``), for type checking only: a loop over such requests reads
    ``cast("list[HoldsKV]", reqs)``, which narrows ``r.kv`` at no cost per request."""

    @property
    def kv(self) -> KVSpan: ...


@dataclass(kw_only=True)
class Req(RequestOptions):
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    arrival: int = field(default_factory=lambda: next(_arrival))
    arrival_time: float = field(default_factory=time.perf_counter)
    # Seconds from arrival to first admission (None until admitted).
    queue_time: float | None = None

    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    # The request's hold on KV memory (None while it holds none); only the KV ledger
    # (runtime/scheduling/kv_ledger.py) writes it.
    kv: KVSpan | None = None
    # Prompt tokens served from the cache when the request was first scheduled.
    cached_tokens: int = -1
    # The rotary set its KV is computed with: LongRoPE's long factors are set 1, else 0
    # (layers/rotary.py). Only runtime/rope_sets.py writes it.
    rope_set: int = 0
    # The load of the LoRA adapter it runs under (LoRAAdapters' id; None: the base model),
    # set at intake; only the scheduler writes it.
    lora_id: int | None = None

    # Logprob accumulators and streaming bookkeeping.
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    sent_len: int = 0
    input_logprobs_done: bool = False
    detokenize_sent: bool = False  # the detokenizer has this request's DetokenizeSettings
    # Its place in its grammar (structured output), from its compile until its finish;
    # only structured_output/grammar_queue.py sets it.
    grammar: GrammarMatcher | None = None
    # An embedding request's pooling, set at intake from the model's (None: it generates).
    pooling: PoolingMethod | None = None
    # The pooled sum of its prompt's chunks so far (mean pooling; a device tensor):
    # only the model worker's pooling (runtime/execution/pooling.py) touches it, in step order.
    pooled: Any = None
    embedding: list[float] | None = None  # the result, once its prompt is computed

    @classmethod
    def from_message(cls, msg: GenerateRequest) -> Req:
        return cls(
            rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=msg.sampling_params, **msg.options()
        )

    def first_admission(self, cached_tokens: int) -> bool:
        """Record when and with how many cached prompt tokens the request was first
        admitted; False (nothing recorded) when a retracted request comes back."""
        if self.cached_tokens >= 0:
            return False
        self.queue_time = time.perf_counter() - self.arrival_time
        self.cached_tokens = cached_tokens
        return True

    def mark_prompt_done(self) -> None:
        """Its whole prompt is computed: prompt logprobs, if asked for, are complete."""
        self.input_logprobs_done = True
        if self.return_logprob and self.input_token_logprobs is None and self.logprob_start_len >= 0:
            self.input_token_logprobs, self.input_top_logprobs = [], []

    @property
    def cache_namespace(self) -> Hashable:
        """What its KV depends on besides its tokens: the prefix cache shares prefixes
        only within a namespace (cache/base.py). None for the plain KV; LongRoPE's long
        set has a namespace of its own, so no prefix computed for a long sequence serves
        a short one, nor the reverse. Within each, every cached key is right for any
        request that matches it: a request on the short set never computes a position at
        or past the original context (it is computed again on the long set first), so
        the short namespace holds only what a short sequence computes, and every key in
        the long one is a long-set key, as HF computes every longer sequence. Each LoRA
        adapter's KV is its own too (``lora_namespace``)."""
        if self.lora_id is not None:
            return lora_namespace(self.lora_id, self.rope_set)
        return ("rope_set", self.rope_set) if self.rope_set else None

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return (
            self.return_logprob
            and 0 <= self.logprob_start_len < len(self.origin_input_ids)
            and not self.input_logprobs_done
        )

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)
