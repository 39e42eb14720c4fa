"""``torch_mla``: multi-head latent attention in plain PyTorch, the reference
every MLA backend is checked against (radixserve/kernels/mla.py has the math).

Extend is the base class's, up-projected (``radixserve.kernels.up_projected_extend``). It gathers each
request's latent entries (cached prefix and new tokens), expands them through
``kv_b_proj`` into per-head keys and values, and runs causal attention with
``qk_nope + rope``-wide keys and ``v_head_dim``-wide values: transformers' own
computation, so a prefill rounds as HF's does.
For a prefill chunk of ``n`` new tokens over ``s`` keys this costs
``s * kv_lora_rank * heads * (nope + v)`` for the expansion plus
``n * s * heads * (nope + rope + v)`` for attention, against
``n * s * heads * (2 * kv_lora_rank + rope)`` absorbed: at V2-Lite's sizes
(512, 128 + 64, 128) expanding is cheaper once a chunk has more than about 170
tokens, and by 2048 tokens it is about 3x cheaper.

Decode absorbs. One new token per request makes the expansion of its whole
context the dominant cost (``s * kv_lora_rank * heads * (nope + v)`` per step
against ``s * heads * (2 * kv_lora_rank + rope)``: about 120x more at V2-Lite's
sizes), so ``W_UK`` goes into the query (``q_nope @ W_UK`` per head, a
``kv_lora_rank``-wide query) and ``W_UV`` into the output, and attention runs
over the shared latent entries directly: one ``[kv_lora_rank + rope]`` entry per
key for all heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.forward_batch import ForwardBatch
from radixserve.kernels import (
    KernelQuery,
    MLAAttentionBackend,
    MLALayerSpec,
    latent_pool,
    mla_reasons,
)


class TorchMLAAttention(MLAAttentionBackend):
    name = "torch_mla"
    priority = 0

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return mla_reasons(query, cls.name)

    def forward_mla_decode(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_b_weight: torch.Tensor,
        layer: MLALayerSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        entries = latent_pool(batch).get_latent(layer.layer_id)
        rank = layer.kv_lora_rank
        max_len = max(batch.seq_lens_cpu)
        slots = batch.req_to_token[batch.req_pool_indices, :max_len]  # [B, S]; padding points anywhere
        mask = torch.arange(max_len, device=q_nope.device)[None, :] < batch.seq_lens[:, None]  # [B, S]
        keys = entries.index_select(0, slots.flatten()).view(*slots.shape, -1).to(q_nope.dtype)  # [B, S, rank + rope]
        w_uk, w_uv = torch.split(kv_b_weight, [layer.qk_nope_head_dim, layer.v_head_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, rank]
        q = torch.cat((q_latent, q_rope), dim=-1).unsqueeze(2)  # [B, H, 1, rank + rope]
        out_latent = F.scaled_dot_product_attention(
            q,
            keys.unsqueeze(1),  # one shared "head" of latent entries
            keys[..., :rank].unsqueeze(1),  # the values are the latents
            attn_mask=mask[:, None, None, :],
            scale=layer.scaling,
            enable_gqa=True,
        ).squeeze(2)  # [B, H, rank]
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]
