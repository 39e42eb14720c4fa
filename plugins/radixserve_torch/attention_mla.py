"""``torch_mla``: multi-head latent attention in plain PyTorch, the reference
every MLA backend is checked against (radixserve/kernels/mla.py has the math).

Extend up-projects. It gathers each request's latent entries (cached prefix and
new tokens), expands them through ``kv_b_proj`` into per-head keys and values,
and runs causal attention with ``qk_nope + rope``-wide keys and ``v_head_dim``
-wide values: transformers' own computation, so a prefill rounds as HF's does.
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
from radixserve.kernels import KernelQuery, MLAAttentionBackend, MLALayerSpec, latent_pool, mla_reasons


class TorchMLAAttention(MLAAttentionBackend):
    name = "torch_mla"
    priority = 0

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return mla_reasons(query, cls.name)

    def forward_mla_extend(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_b_weight: torch.Tensor,
        layer: MLALayerSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        entries = latent_pool(batch).get_latent(layer.layer_id)
        heads, nope, v_dim = layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim
        # Every request's keys at once: one gather and one up-projection (HF's kv_b_proj).
        slots = torch.cat([batch.req_to_token[batch.req_pool_indices[i], :s] for i, s in enumerate(batch.seq_lens_cpu)])
        context = entries.index_select(0, slots).to(q_nope.dtype)
        latent, k_rope = context.split([layer.kv_lora_rank, layer.qk_rope_head_dim], dim=-1)
        kv = F.linear(latent, kv_b_weight.flatten(0, 1)).view(-1, heads, nope + v_dim)
        k_nope, values = kv.split([nope, v_dim], dim=-1)
        keys = torch.cat((k_nope, k_rope.unsqueeze(1).expand(-1, heads, -1)), dim=-1)  # [S, H, nope + rope]
        queries = torch.cat((q_nope, q_rope), dim=-1)  # [T, H, nope + rope]
        out = q_nope.new_empty((q_nope.shape[0], heads, v_dim))
        first_key = 0
        for i, start in enumerate(batch.extend_start_loc):
            n, seq_len = batch.extend_lens_cpu[i], batch.seq_lens_cpu[i]
            prefix = seq_len - n
            # Query j sits at position prefix + j and sees keys 0..prefix + j.
            mask = torch.ones(n, seq_len, dtype=torch.bool, device=q_nope.device).tril(prefix) if prefix else None
            q = queries[start : start + n].transpose(0, 1)
            k = keys[first_key : first_key + seq_len].transpose(0, 1)
            v = values[first_key : first_key + seq_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scaling)
            out[start : start + n] = o.transpose(0, 1)
            first_key += seq_len
        return out

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
        w_uk, w_uv = kv_b_weight.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=1)
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
