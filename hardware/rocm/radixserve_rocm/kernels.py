"""Attention and MoE on AMD GPUs: radixserve's Triton kernels with launch
configurations for CDNA (MI200 / MI300, gfx90a / gfx942).

The kernels are the Triton plugin's, reached through its public API
(``radixserve_triton``: the backend classes and their ``kernel_config``). What
differs on CDNA, and why:

* A wavefront is 64 lanes where an NVIDIA warp is 32, so ``num_warps`` counts
  64-lane waves. The configurations keep the lanes per element of the NVIDIA
  defaults: decode runs 2 waves (128 lanes, as 4 warps of 32) on its 16 x 64
  score tile; extend doubles the query block to 64 rows for its 4 waves (256
  lanes), as does the KV store (32 rows).
* A CU has 64 KiB of LDS (shared memory), against up to 228 KB per SM on
  Hopper. ``num_stages=1`` stops the software pipeliner from double-buffering
  the K/V tiles in LDS: compiled for gfx942, the NVIDIA defaults need 68 KiB
  for float32 decode at head dim 128 (more than a CU has), these need 32 KiB
  (16 KiB in 16-bit dtypes). MoE keeps two stages but with 64-deep K blocks in
  16-bit dtypes (8 KiB per stage) and 32-deep in float32.
* MI300X has 304 CUs (H100: 132 SMs), so flash-decoding splits a long sequence
  until about 608 programs run rather than 256.

These are chosen from the hardware's shape and checked by compiling every
kernel for gfx90a and gfx942 (tests/test_rocm_plugin.py), not tuned on an AMD
GPU: no timings back them yet.
"""

from __future__ import annotations

from radixserve.kernels import KernelQuery
from radixserve_triton import AttentionKernelConfig, MoEKernelConfig, TritonAttention, TritonMoE

CDNA_ATTENTION_CONFIG = AttentionKernelConfig(
    store_block_t=32,
    decode_block_n=64,
    extend_block_m=64,
    extend_block_n=64,
    num_warps=4,
    decode_num_warps=2,
    num_stages=1,
    decode_target_programs=608,
)

CDNA_MOE_CONFIG = MoEKernelConfig(
    block_n=64,
    block_k=64,
    block_k_fp32=32,
    num_warps=4,
    num_stages=2,
)


def rocm_only_reasons(query: KernelQuery, what: str) -> list[str]:
    if query.device == "rocm":
        return []
    return [
        f"{what} with CDNA launch configurations runs on the rocm platform, not {query.device!r} "
        "(the triton backend serves other devices)"
    ]


class RocmTritonAttention(TritonAttention):
    """``triton_rocm``: the Triton paged attention with ``CDNA_ATTENTION_CONFIG``;
    on ``rocm`` it outranks the generic ``triton`` backend."""

    name = "triton_rocm"
    priority = 20
    kernel_config = CDNA_ATTENTION_CONFIG

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return rocm_only_reasons(query, "Triton attention") or super().unsupported_reasons(query)


class RocmTritonMoE(TritonMoE):
    """``triton_rocm``: the Triton fused MoE with ``CDNA_MOE_CONFIG``."""

    name = "triton_rocm"
    priority = 20
    kernel_config = CDNA_MOE_CONFIG

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return rocm_only_reasons(query, "Triton fused MoE") or super().unsupported_reasons(query)
