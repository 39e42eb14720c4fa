"""Turns the scheduler's chosen requests into a ForwardBatch, in two halves.

At launch the scheduler fixes the step's batch (``BatchPlan.launch``): the
lists go to the device and the new tokens' KV slots into the request rows of
``req_to_token``, so the scheduler can read a request's slots back from there
whenever it caches or frees them. The KV ledger calls it with the slots it
allocated (``KVLedger.allocate``'s ``record``) and takes them back if it fails.
The model worker then builds the ``ForwardBatch`` (``BatchPlan.build``) just
before running it, gathering the token ids from the token table
(``ReqToTokenPool.token_ids``): with overlap scheduling the step before may
still be computing at launch, and only the worker, which runs steps in launch
order, reads the token that step sampled where its sampler wrote it.

Token ids are read by index, not from the requests' Python lists: a step costs
a few small host -> device copies (rows, lengths, slots) whatever the requests'
lengths, none of which waits for the device (radixserve/transfer.py). The
slot writes of a launch touch positions the step still computing never reads
(the ones after its tokens, or rows no running step holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.cache.memory_pool import KVPool, ReqToTokenPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import LoRABatch
from radixserve.runtime.execution.pooling import EmbedRows
from radixserve.runtime.execution.request import Req
from radixserve.transfer import HostTransfer


@dataclass
class BatchPlan:
    """One step's batch: each request (row ``rows[i]`` of the token table) extends
    ``extend_lens[i]`` tokens after its ``prefix_lens[i]`` cached ones, into the
    KV slots ``out_cache_loc`` (laid out in request order)."""

    mode: ForwardMode
    prefix_lens: list[int]
    extend_lens: list[int]
    rows: torch.Tensor
    prefix_t: torch.Tensor
    extend_t: torch.Tensor
    token_rows: torch.Tensor  # per new token: its request's row
    positions: torch.Tensor  # per new token: its position in the request
    out_cache_loc: torch.Tensor
    logits_indices: torch.Tensor
    rope_rows: torch.Tensor | None = None  # per new token, its row of the rotary table (None: its position)
    out_cache_loc_cpu: list[int] = field(default_factory=list)  # the slots, on the host
    lora: LoRABatch | None = None  # each token's adapter slot (multi-LoRA serving)

    @classmethod
    def launch(
        cls,
        mode: ForwardMode,
        rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        logits_indices: list[int],
        rope_offsets: list[int] | None,
        req_to_token_pool: ReqToTokenPool,
        transfer: HostTransfer,
        out_cache_loc: list[int],
        *,
        lora: LoRABatch | None = None,
    ) -> BatchPlan:
        """The plan of requests at token table ``rows`` with ``prefix_lens`` tokens
        computed and ``extend_lens`` new; records the new tokens' slots
        ``out_cache_loc`` in their rows (the ledger's ``record``: last, so that a
        ``partial`` of the others is one). ``rope_offsets``: per request, the first
        row of its set in the rotary table (LongRoPE; None or all 0: one set)."""
        tensor, device = transfer.to_device, transfer.device
        rows_t, prefix_t, extend_t = tensor(rows), tensor(prefix_lens), tensor(extend_lens)
        slots = tensor(out_cache_loc)
        num_tokens = len(out_cache_loc)
        if mode is ForwardMode.DECODE:
            token_rows, positions = rows_t, prefix_t
        else:
            token_rows = rows_t.repeat_interleave(extend_t, output_size=num_tokens)
            # Position of each new token: its request's prefix length plus its index among the new ones.
            first = extend_t.cumsum(0) - extend_t
            within = torch.arange(num_tokens, device=device) - first.repeat_interleave(extend_t, output_size=num_tokens)
            positions = prefix_t.repeat_interleave(extend_t, output_size=num_tokens) + within
        rope_rows = None
        if rope_offsets and any(rope_offsets):  # LongRoPE: the rows of each request's set
            offsets = tensor(rope_offsets)
            if mode is ForwardMode.EXTEND:
                offsets = offsets.repeat_interleave(extend_t, output_size=num_tokens)
            rope_rows = positions + offsets
        # The new tokens' KV slots go into their rows in one scatter.
        req_to_token_pool.req_to_token.index_put_((token_rows, positions), slots)
        return cls(
            mode,
            prefix_lens,
            extend_lens,
            rows_t,
            prefix_t,
            extend_t,
            token_rows,
            positions,
            slots,
            tensor(logits_indices),
            rope_rows,
            out_cache_loc,
            lora,
        )

    def build(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool) -> ForwardBatch:
        """The ForwardBatch, its token ids read from the token table now."""
        return ForwardBatch(
            mode=self.mode,
            input_ids=req_to_token_pool.token_ids[self.token_rows, self.positions],
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=self.rows,
            seq_lens=self.prefix_t + self.extend_t,
            prefix_lens=self.prefix_t,
            extend_lens=self.extend_t,
            req_to_token=req_to_token_pool.req_to_token,
            kv_pool=kv_pool,
            seq_lens_cpu=[p + n for p, n in zip(self.prefix_lens, self.extend_lens, strict=True)],
            prefix_lens_cpu=list(self.prefix_lens),
            extend_lens_cpu=list(self.extend_lens),
            logits_indices=self.logits_indices,
            rope_table_rows=self.rope_rows,
            lora=self.lora,
        )


@dataclass
class PromptLogprobRows:
    """Logits rows ``[row, row + len(targets))`` score prompt tokens ``targets`` of ``req``."""

    req: Req
    row: int
    targets: list[int]


@dataclass
class LogitsRows:
    """Which of a step's token rows get logits: ``indices``, in which the rows from
    ``sample_rows[i]`` on sample the next token of ``sample_reqs[i]``, ``prompt``
    lists the spans that score prompt tokens (prompt logprobs) and ``embed`` the
    spans that embedding requests pool (runtime/execution/pooling.py)."""

    indices: list[int] = field(default_factory=list)
    sample_reqs: list[Req] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt: list[PromptLogprobRows] = field(default_factory=list)
    embed: list[EmbedRows] = field(default_factory=list)

    @classmethod
    def decode(cls, reqs: list[Req]) -> LogitsRows:
        rows = list(range(len(reqs)))
        return cls(rows, list(reqs), rows)

    @classmethod
    def verify(cls, reqs: list[Req], extend_lens: list[int]) -> LogitsRows:
        """A verify step (speculative decoding): every token row gets logits, and a
        request's ``extend_lens[i]`` rows all sample, for it (``StepWork.verify``)."""
        rows = list(range(sum(extend_lens)))
        return cls(rows, [r for r, n in zip(reqs, extend_lens, strict=True) for _ in range(n)], rows)

    @classmethod
    def extend(cls, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int]) -> LogitsRows:
        """Each request computes tokens ``[start, start + n)``; it samples when that ends
        its sequence, and scores the prompt tokens it was asked for."""
        out = cls()
        offset = 0
        for req, start, n in zip(reqs, prefix_lens, extend_lens, strict=True):
            if req.wants_input_logprobs:
                # Position p's logits score token p + 1; prompt token t needs row t - 1.
                # This step's rows score tokens start+1 .. start+n.
                first = max(req.logprob_start_len, start + 1)
                last = min(start + n + 1, len(req.origin_input_ids))  # exclusive
                if last > first:
                    out.prompt.append(PromptLogprobRows(req, len(out.indices), req.origin_input_ids[first:last]))
                    out.indices.extend(offset + (t - 1 - start) for t in range(first, last))
            if start + n == req.seq_len and req.sampling_params.max_new_tokens > 0:
                out.sample_reqs.append(req)
                out.sample_rows.append(len(out.indices))
                out.indices.append(offset + n - 1)
            embed = EmbedRows.of(req, start, n)
            if embed is not None:
                out.embed.append(embed)
                out.indices.extend(range(offset + n - embed.count, offset + n))
            offset += n
        return out
