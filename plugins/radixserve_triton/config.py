"""Launch configurations of the Triton kernels: block sizes, ``num_warps`` and
the decode split heuristic, one frozen dataclass per kernel family.

The defaults are what the kernels have always used (tuned on NVIDIA GPUs, 32-wide
warps). A hardware plugin that wants other values for its GPUs (the ROCm plugin:
64-wide CDNA wavefronts, 64 KiB of LDS) subclasses ``TritonAttention`` /
``TritonMoE`` (or ``TritonLoRA``) and sets their ``kernel_config`` class attribute; see
``radixserve_triton``'s ``__all__`` for the public names. Importing this module
never imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionKernelConfig:
    """Tiles and launch options of the paged attention kernels (``ops/attention.py``).

    ``*_block_n`` are key blocks for head dims up to ``large_head_dim``; above it
    they halve (register/shared-memory pressure), and fp32 extend at large head
    dims uses ``extend_block_n_fp32_large_head``. ``num_stages``/``waves_per_eu``
    of ``None`` leave Triton's default (``waves_per_eu`` is an AMD occupancy hint
    that other backends ignore).
    """

    store_block_t: int = 16
    decode_block_n: int = 64
    extend_block_m: int = 32
    extend_block_n: int = 64
    large_head_dim: int = 128
    extend_block_n_fp32_large_head: int = 16  # fp32 at head_dim 256 stays under ~100 KB of shared memory (sm_86/89)
    num_warps: int = 4
    decode_num_warps: int | None = None  # None: num_warps
    num_stages: int | None = None
    waves_per_eu: int | None = None
    # Flash-decoding splits: enough programs to fill the device, each split >= min_keys_per_split keys.
    decode_target_programs: int = 256
    max_kv_splits: int = 16
    min_keys_per_split: int = 128

    def decode_block_n_for(self, head_dim: int) -> int:
        return self.decode_block_n if head_dim <= self.large_head_dim else self.decode_block_n // 2

    def extend_block_n_for(self, head_dim: int, dtype: torch.dtype) -> int:
        if head_dim <= self.large_head_dim:
            return self.extend_block_n
        if dtype == torch.float32:
            return self.extend_block_n_fp32_large_head
        return self.extend_block_n // 2

    def num_kv_splits(self, batch_size: int, num_kv_heads: int, max_seq_len: int) -> int:
        """Split long sequences across programs when the batch alone cannot fill the device."""
        programs = max(1, batch_size * num_kv_heads)
        by_device = -(-self.decode_target_programs // programs)
        by_length = -(-max_seq_len // self.min_keys_per_split)
        return max(1, min(self.max_kv_splits, by_device, by_length))

    def launch_options(self, decode: bool = False) -> dict[str, int]:
        """Keyword options for ``kernel[grid](..., **options)``."""
        warps = self.decode_num_warps if decode and self.decode_num_warps is not None else self.num_warps
        return _options(warps, self.num_stages, self.waves_per_eu)


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tiles and launch options of the fused MoE kernels (``ops/moe.py``).

    ``block_m`` follows the rows per expert: ``block_m_small`` up to
    ``small_rows`` rows (decode), ``block_m_medium`` up to ``medium_rows``, else
    ``block_m_large``. ``block_k_fp32`` (when set) replaces ``block_k`` for
    float32 weights, whose tiles take twice the shared memory.
    """

    block_m_small: int = 16
    block_m_medium: int = 32
    block_m_large: int = 64
    small_rows: int = 16
    medium_rows: int = 64
    block_n: int = 64
    block_k: int = 32
    block_k_fp32: int | None = None
    num_warps: int = 4
    num_stages: int | None = None
    waves_per_eu: int | None = None

    def blocks(self, num_assignments: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
        """``(block_m, block_n, block_k)`` for this many (token, expert) assignments."""
        per_expert = num_assignments / max(1, num_experts)
        if per_expert <= self.small_rows:
            block_m = self.block_m_small
        elif per_expert <= self.medium_rows:
            block_m = self.block_m_medium
        else:
            block_m = self.block_m_large
        block_k = self.block_k_fp32 if dtype == torch.float32 and self.block_k_fp32 else self.block_k
        return block_m, self.block_n, block_k

    def launch_options(self) -> dict[str, int]:
        return _options(self.num_warps, self.num_stages, self.waves_per_eu)


@dataclass(frozen=True)
class LoRAKernelConfig:
    """Tiles and launch options of the SGMV kernels (``ops/lora.py``).

    A program takes one block of tokens of one run: ``block_t_small`` tokens when
    no run is longer (decode: a token a request; 16 is ``tl.dot``'s least), else
    ``block_t``. The shrink tiles the input features by ``shrink_block_in`` and the
    rank columns by ``block_k`` (a narrower K takes one tile of its next power of
    two, masked); the expand tiles each projection's output features by
    ``expand_block_n`` and sums over its r rank columns in tiles of ``blocks``'s
    width for K = r.
    """

    block_t_small: int = 16
    block_t: int = 64
    block_k: int = 64
    shrink_block_in: int = 64
    expand_block_n: int = 64
    num_warps: int = 4
    num_stages: int | None = None
    waves_per_eu: int | None = None

    def blocks(self, max_segment_len: int, rank_columns: int) -> tuple[int, int]:
        """``(block_t, block_k)`` for runs of up to ``max_segment_len`` tokens summing over
        ``rank_columns`` (the shrink's K = n * r; the expand's r)."""
        block_t = self.block_t_small if max_segment_len <= self.block_t_small else self.block_t
        return block_t, min(self.block_k, max(16, 1 << (rank_columns - 1).bit_length()))

    def launch_options(self) -> dict[str, int]:
        return _options(self.num_warps, self.num_stages, self.waves_per_eu)


def _options(num_warps: int, num_stages: int | None, waves_per_eu: int | None) -> dict[str, int]:
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if waves_per_eu is not None:
        options["waves_per_eu"] = waves_per_eu
    return options


DEFAULT_ATTENTION_CONFIG = AttentionKernelConfig()
DEFAULT_MOE_CONFIG = MoEKernelConfig()
DEFAULT_LORA_CONFIG = LoRAKernelConfig()
