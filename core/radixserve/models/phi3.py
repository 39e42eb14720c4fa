"""Phi-3 (mini, medium; 4k and 128k): Llama's decoder with the q/k/v and gate/up
projections fused in the checkpoint (``self_attn.qkv_proj``: q rows, then k, then
v; ``mlp.gate_up_proj``: gate rows, then up). Our layers are fused the same way,
and their weight loaders split a fused checkpoint tensor into its parts, so each
tensor-parallel rank takes its own query heads, KV heads and gate/up rows from
it. The 128k models use LongRoPE (``rope_scaling`` type ``longrope``; see
``layers/rotary.py``); a ``sliding_window`` shorter than the context applies to
every layer, as in Mistral.
"""

from __future__ import annotations

from radixserve.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    architectures = ("Phi3ForCausalLM",)
