"""Turns the scheduler's chosen requests into a ForwardBatch.

Token ids come from the device-resident token table (``ReqToTokenPool.token_ids``)
by index, not from the requests' Python lists: a step costs a few small host
-> device copies (rows, lengths) whatever the requests' lengths, and a token
sampled in the previous step is read where the sampler wrote it.
"""

from __future__ import annotations

import torch

from radixserve.cache.memory_pool import KVPool, ReqToTokenPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.runtime.req import Req


def build_forward_batch(
    mode: ForwardMode,
    reqs: list[Req],
    out_cache_loc: torch.Tensor,
    logits_indices: list[int],
    req_to_token_pool: ReqToTokenPool,
    kv_pool: KVPool,
    device: torch.device,
) -> ForwardBatch:
    """Each request extends ``req.extend_len`` tokens after its ``req.kv_len`` cached ones,
    into the KV slots ``out_cache_loc`` (laid out in request order), which this
    records in the requests' rows of ``req_to_token``."""
    prefix_lens = [r.kv_len for r in reqs]
    extend_lens = [r.extend_len for r in reqs]
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    rows = tensor([r.req_pool_idx for r in reqs])
    prefix_t = tensor(prefix_lens)
    extend_t = tensor(extend_lens)
    if mode is ForwardMode.DECODE:
        token_rows, positions = rows, prefix_t
    else:
        num_tokens = sum(extend_lens)
        token_rows = rows.repeat_interleave(extend_t, output_size=num_tokens)
        # Position of each new token: its request's prefix length plus its index among the new ones.
        first = extend_t.cumsum(0) - extend_t
        within = torch.arange(num_tokens, device=device) - first.repeat_interleave(extend_t, output_size=num_tokens)
        positions = prefix_t.repeat_interleave(extend_t, output_size=num_tokens) + within
    # The new tokens' KV slots go into their rows in one scatter.
    req_to_token_pool.req_to_token.index_put_((token_rows, positions), out_cache_loc)
    return ForwardBatch(
        mode=mode,
        input_ids=req_to_token_pool.token_ids[token_rows, positions],
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=rows,
        seq_lens=prefix_t + extend_t,
        prefix_lens=prefix_t,
        extend_lens=extend_t,
        req_to_token=req_to_token_pool.req_to_token,
        kv_pool=kv_pool,
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
        logits_indices=tensor(logits_indices),
    )
