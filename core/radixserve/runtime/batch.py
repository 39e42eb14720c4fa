"""Turns the scheduler's chosen requests into a ForwardBatch."""

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
    """Each request extends ``req.extend_len`` tokens after its ``req.kv_len`` cached ones."""
    input_ids: list[int] = []
    positions: list[int] = []
    prefix_lens, extend_lens, seq_lens = [], [], []
    for req in reqs:
        start, n = req.kv_len, req.extend_len
        input_ids.extend(req.fill_ids[start : start + n])
        positions.extend(range(start, start + n))
        prefix_lens.append(start)
        extend_lens.append(n)
        seq_lens.append(start + n)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        mode=mode,
        input_ids=tensor(input_ids),
        positions=tensor(positions),
        out_cache_loc=out_cache_loc,
        req_pool_indices=tensor([r.req_pool_idx for r in reqs]),
        seq_lens=tensor(seq_lens),
        prefix_lens=tensor(prefix_lens),
        extend_lens=tensor(extend_lens),
        req_to_token=req_to_token_pool.req_to_token,
        kv_pool=kv_pool,
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
        logits_indices=tensor(logits_indices),
    )
