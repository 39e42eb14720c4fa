"""A stand-in for torch_npu on the CPU: the operators radixserve_npu calls,
emulated in torch from torch_npu's documentation, with the documented argument
checks, so that the NPU attention and MoE paths run (and are checked against the
torch reference) on any machine. It lives in tests, never in the plugin; tests
put it in place of the real module with :func:`install`.

Emulated, and only in the forms the plugin uses:

- ``npu_fused_infer_attention_score`` with ``input_layout="BNSD"`` and
  PageAttention (``block_table``): key/value caches ``(blocknum, blocksize, H)``
  or ``(blocknum, KV_N, blocksize, D)``; one query per request (any
  ``block_size`` that is a multiple of 16) or several (``block_size`` 128..512 in
  steps of 128, ``actual_seq_lengths`` per request, ``sparse_mode=3`` with the
  2048 x 2048 upper-triangular mask: query ``j`` of ``n`` sees keys
  ``0 .. kv_len - n + j``).
- ``npu_grouped_matmul`` with one ``x``, one 3-D ``weight``, ``group_type=0``,
  ``split_item`` 2 or 3 and a cumulative ``group_list`` tensor.
- ``npu.device_count``, ``npu.mem_get_info``, ``npu.get_device_name``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


class StandInError(RuntimeError):
    """An argument the documented operator would reject."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise StandInError(message)


@dataclass
class StandInDevice:
    """``torch_npu.npu``: what the platform asks about the device."""

    count: int = 1
    free_bytes: int = 60 * 2**30
    total_bytes: int = 64 * 2**30
    device_name: str = "Ascend910B-standin"

    def device_count(self) -> int:
        return self.count

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        _require(0 <= index < self.count, f"no npu:{index}")
        return self.free_bytes, self.total_bytes

    def get_device_name(self, index: int = 0) -> str:
        return self.device_name


@dataclass
class StandInTorchNpu:
    """The ``torch_npu`` module as the plugin sees it; ``calls`` records each operator call."""

    npu: StandInDevice = field(default_factory=StandInDevice)
    with_grouped_matmul: bool = True
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    __version__ = "stand-in"

    def __getattr__(self, name: str) -> Any:
        if name == "npu_grouped_matmul" and self.with_grouped_matmul:
            return self._grouped_matmul
        raise AttributeError(name)

    # -- attention ---------------------------------------------------------

    def npu_fused_infer_attention_score(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        block_table: torch.Tensor | None = None,
        block_size: int = 0,
        actual_seq_lengths: list[int] | None = None,
        actual_seq_lengths_kv: list[int] | None = None,
        num_heads: int = 1,
        num_key_value_heads: int = 0,
        input_layout: str = "BSH",
        scale: float = 1.0,
        sparse_mode: int = 0,
        atten_mask: torch.Tensor | None = None,
        **others: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(
            (
                "npu_fused_infer_attention_score",
                dict(
                    q_shape=tuple(query.shape),
                    key_shape=tuple(key.shape),
                    block_size=block_size,
                    sparse_mode=sparse_mode,
                    actual_seq_lengths=actual_seq_lengths,
                    actual_seq_lengths_kv=actual_seq_lengths_kv,
                    block_table=block_table.clone(),
                ),
            )
        )
        _require(not others, f"the stand-in does not emulate {sorted(others)}")
        _require(input_layout == "BNSD", f"the stand-in emulates input_layout BNSD, got {input_layout!r}")
        _require(query.dim() == 4 and query.is_contiguous(), "query must be a contiguous BNSD tensor")
        _require(query.dtype in HALF_DTYPES, f"query dtype {query.dtype}: float16 or bfloat16 only")
        _require(key.dtype == value.dtype == query.dtype, "key/value dtype must match the query's")
        _require(
            key.shape == value.shape and key.is_contiguous() and value.is_contiguous(),
            "key and value must be contiguous and of one shape",
        )
        batch, heads, q_len, dim = query.shape
        kv_heads = num_key_value_heads or num_heads
        _require(heads == num_heads, f"num_heads {num_heads} != the query's N {heads}")
        _require(heads % kv_heads == 0 and heads // kv_heads <= 64, "num_heads / num_key_value_heads")
        _require(dim % 16 == 0, f"D {dim} must be 16-aligned for float16/bfloat16")

        # PageAttention
        _require(
            block_table is not None and block_table.dtype == torch.int32 and block_table.dim() == 2,
            "block_table must be a 2-D int32 tensor",
        )
        _require(block_table.shape[0] == batch, "block_table's first dim must be B")
        _require(
            isinstance(actual_seq_lengths_kv, list)
            and all(isinstance(n, int) for n in actual_seq_lengths_kv)
            and len(actual_seq_lengths_kv) >= batch,
            "actual_seq_lengths_kv: a host list of B ints",
        )
        kv_lens = actual_seq_lengths_kv[:batch]
        if q_len == 1:
            _require(block_size > 0 and block_size % 16 == 0, f"block_size {block_size}: 16-aligned for Q_S 1")
        else:
            _require(block_size in (128, 256, 384, 512), f"block_size {block_size}: 128..512 in steps of 128")
        blocks_needed = [math.ceil(n / block_size) for n in kv_lens]
        _require(block_table.shape[1] >= max(blocks_needed), "block_table is narrower than maxBlockNumPerSeq")
        if key.dim() == 3:  # (blocknum, blocksize, H)
            _require(key.shape[1] == block_size and key.shape[2] == kv_heads * dim, "key (blocknum, blocksize, H)")
            _require(kv_heads * dim <= 65535, "KV_N * D above 65535 with the (blocknum, blocksize, H) cache")
            pages = lambda cache: cache.view(cache.shape[0], block_size, kv_heads, dim)  # noqa: E731
        else:  # (blocknum, KV_N, blocksize, D)
            _require(
                key.dim() == 4 and tuple(key.shape[1:]) == (kv_heads, block_size, dim),
                "key (blocknum, KV_N, blocksize, D)",
            )
            pages = lambda cache: cache.transpose(1, 2)  # noqa: E731
        num_blocks = key.shape[0]
        _require(sum(blocks_needed) <= num_blocks, "blocknum below the blocks the batch needs")

        if q_len > 1:
            _require(
                isinstance(actual_seq_lengths, list)
                and len(actual_seq_lengths) >= batch
                and all(0 < n <= q_len for n in actual_seq_lengths[:batch]),
                "actual_seq_lengths",
            )
            _require(sparse_mode == 3, "the stand-in emulates causal prefill as sparse_mode 3")
            expected_mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
            _require(
                atten_mask is not None
                and atten_mask.dtype == torch.bool
                and torch.equal(atten_mask.cpu(), expected_mask),
                "sparse_mode 3 needs the 2048 x 2048 mask",
            )
            q_lens = actual_seq_lengths[:batch]
        else:
            q_lens = [1] * batch

        out = torch.zeros(query.shape, dtype=torch.float32)
        group = heads // kv_heads
        for b in range(batch):
            used = block_table[b, : blocks_needed[b]].long()
            _require(bool(((used >= 0) & (used < num_blocks)).all()), "block id out of range")
            k = pages(key)[used].reshape(-1, kv_heads, dim)[: kv_lens[b]].float()  # [L, KVH, D]
            v = pages(value)[used].reshape(-1, kv_heads, dim)[: kv_lens[b]].float()
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            n = q_lens[b]
            scores = torch.einsum("hqd,khd->hqk", query[b, :, :n].float(), k) * scale
            if q_len > 1:  # right-down causal: query j sees keys 0 .. L - n + j
                q_pos = torch.arange(n)[:, None] + kv_lens[b] - n
                scores = scores.masked_fill(torch.arange(kv_lens[b])[None, :] > q_pos, float("-inf"))
            out[b, :, :n] = torch.einsum("hqk,khd->hqd", torch.softmax(scores, dim=-1), v)
        return out.to(query.dtype), torch.zeros(1)

    # -- MoE ---------------------------------------------------------------

    def _grouped_matmul(
        self,
        x: list[torch.Tensor],
        weight: list[torch.Tensor],
        *,
        group_list: torch.Tensor | None = None,
        split_item: int = 0,
        group_type: int | None = None,
        group_list_type: int = 0,
        **others: Any,
    ) -> list[torch.Tensor]:
        self.calls.append(("npu_grouped_matmul", dict(group_list=group_list.clone())))
        _require(not others, f"the stand-in does not emulate {sorted(others)}")
        _require(len(x) == 1 and len(weight) == 1, "the stand-in emulates one x and one weight tensor")
        _require(
            split_item in (2, 3) and group_type == 0 and group_list_type == 0,
            "single x/weight/y needs split_item 2|3, group_type 0; group_list_type 0 is a cumsum",
        )
        a, w = x[0], weight[0]
        _require(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], "x [M, K], weight [E, K, N]")
        _require(a.dtype == w.dtype, "x and weight dtypes differ")
        _require(
            isinstance(group_list, torch.Tensor)
            and group_list.dtype == torch.int64
            and group_list.dim() == 1
            and group_list.numel() == w.shape[0] <= 1024,
            "group_list: int64 [E], E <= 1024",
        )
        bounds = [0, *group_list.tolist()]
        _require(
            all(lo <= hi for lo, hi in zip(bounds, bounds[1:], strict=False)) and bounds[-1] == a.shape[0],
            "group_list must be non-decreasing and end at M",
        )
        y = torch.empty(a.shape[0], w.shape[2], dtype=torch.float32)
        for e in range(w.shape[0]):
            y[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]].float() @ w[e].float()
        return [y.to(a.dtype)]

    def count(self, name: str) -> int:
        return sum(1 for called, _ in self.calls if called == name)


def install(monkeypatch, standin: StandInTorchNpu | None = None) -> StandInTorchNpu:
    """Make radixserve_npu's operator lookup return ``standin`` (for this test only)."""
    import radixserve_npu.ops

    standin = standin or StandInTorchNpu()
    monkeypatch.setattr(radixserve_npu.ops, "load_torch_npu", lambda: standin)
    return standin
