"""``example_sdpa``: paged attention as one masked matmul-softmax per request."""

from __future__ import annotations

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.kernels import AttentionBackend, AttentionLayerSpec, KernelQuery, attention_feature_reasons

SUPPORTED_DEVICES = ("cpu", "cuda")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ExampleSDPAttention(AttentionBackend):
    """Gathers each request's K/V through ``req_to_token`` and computes
    ``softmax(q k^T * scale + causal mask) v`` in float32, with GQA done by
    grouping query heads (no K/V repetition).

    The inherited ``AttentionBackend.forward`` stores the new K/V into the pool
    at ``batch.out_cache_loc`` first, then calls ``forward_extend`` or
    ``forward_decode``; a backend with its own store kernel overrides ``forward``.
    """

    name = "example_sdpa"
    # Below torch_native (0): `auto` never picks the example; ask for it by name
    # (--attention-backend example_sdpa).
    priority = -10

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        # Cheap and side-effect free: look at the query only.
        reasons = attention_feature_reasons(query, cls.name)
        if query.device not in SUPPORTED_DEVICES:
            reasons.append(f"device {query.device!r} is not one of {SUPPORTED_DEVICES}")
        if query.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {query.dtype} is not supported")
        if query.num_heads and query.num_kv_heads and query.num_heads % query.num_kv_heads:
            reasons.append(f"num_heads {query.num_heads} is not a multiple of num_kv_heads {query.num_kv_heads}")
        return reasons

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        out = torch.empty_like(q)
        start = 0
        for i in range(batch.batch_size):
            n, seq_len = batch.extend_lens_cpu[i], batch.seq_lens_cpu[i]
            slots = batch.req_to_token[batch.req_pool_indices[i], :seq_len]
            out[start : start + n] = _attend(q[start : start + n], k_buf[slots], v_buf[slots], seq_len - n, layer)
            start += n
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        # Decode is an extend of one token per request.
        return self.forward_extend(q, layer, batch)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, layer: AttentionLayerSpec) -> torch.Tensor:
    """q ``[n, H, D]`` at positions ``prefix..prefix+n-1``; k/v ``[S, KVH, D]`` -> ``[n, H, D]``."""
    n, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qg = q.float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KVH, G, n, D]
    kf = k.float().transpose(0, 1)  # [KVH, S, D]
    vf = v.float().transpose(0, 1)
    scores = torch.matmul(qg, kf.unsqueeze(1).transpose(-1, -2)) * layer.scaling  # [KVH, G, n, S]
    q_pos = prefix + torch.arange(n, device=q.device)
    visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf.unsqueeze(1))  # [KVH, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(q.dtype)
