"""Attention cases: ``AttentionCase`` (one batch of requests), the paged or
contiguous inputs it makes (``make_attention_inputs``) and ``with_kv_layout``
(a pool's contents in the layout a backend reads)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from radixserve.cache.memory_pool import KVLayout, KVPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels.attention import AttentionLayerSpec
from radixserve.kernels.query import KernelQuery


@dataclass(frozen=True)
class AttentionCase:
    """One attention batch: request ``i`` has ``prefix_lens[i]`` tokens already in
    the pool and ``extend_lens[i]`` new ones (all 1 in decode).

    ``sliding_window`` and ``logit_softcap`` are the layer's (``AttentionLayerSpec``)
    and the query's: a backend that refuses them skips the case. A windowed case
    also runs a global layer (no window, the same cap) in the same step, as
    models that interleave windowed and global layers do."""

    name: str
    mode: str  # "extend" or "decode"
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    scaling: float | None = None  # None: head_dim ** -0.5
    layer_id: int = 1  # a layer other than 0, in a pool with layer_id + 2 layers
    sliding_window: int | None = None  # a query at position p sees keys p - window + 1 .. p
    logit_softcap: float | None = None  # scaled scores -> cap * tanh(scores / cap)

    def __post_init__(self) -> None:
        if self.mode not in ("extend", "decode"):
            raise ValueError(f"mode must be 'extend' or 'decode', got {self.mode!r}")
        if len(self.prefix_lens) != len(self.extend_lens):
            raise ValueError("prefix_lens and extend_lens differ in length")
        if self.mode == "decode" and any(n != 1 for n in self.extend_lens):
            raise ValueError("decode cases have exactly one new token per request")
        if any(n < 1 for n in self.extend_lens):
            raise ValueError("every request needs at least one new token")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0, got {self.logit_softcap}")

    @property
    def softmax_scale(self) -> float:
        return self.scaling if self.scaling is not None else self.head_dim**-0.5

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        return KernelQuery(
            device=device,
            dtype=dtype,
            head_dim=self.head_dim,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            page_size=self.page_size,
            kv_dtype=dtype,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )

    @property
    def global_layer_id(self) -> int | None:
        """The layer of the full-attention pass a windowed case adds (None: no window)."""
        return None if self.sliding_window is None else self.layer_id + 1


@dataclass
class AttentionInputs:
    """Everything one attention call needs, plus the logical (unpaged) K/V."""

    case: AttentionCase
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KVH, D] new tokens
    v: torch.Tensor
    layer: AttentionLayerSpec
    batch: ForwardBatch
    # Per request, all seq_len keys/values in position order (prefix then new).
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # A windowed case's full-attention layer (same K/V, same cap), run in the same step.
    global_layer: AttentionLayerSpec | None = None


def make_attention_inputs(
    case: AttentionCase,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    layout: str = "paged",
) -> AttentionInputs:
    """Random inputs for ``case``: ``layout="paged"`` scatters each request over
    randomly chosen pages (slots permuted, request rows shuffled, unused slots and
    table entries full of garbage); ``"contiguous"`` lays requests out one after
    another from slot ``page_size`` on, in request slot order. A windowed case's
    prefix is stored in its global layer too."""
    if layout not in ("paged", "contiguous"):
        raise ValueError(f"layout must be 'paged' or 'contiguous', got {layout!r}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    ps = case.page_size
    prefix, extend = list(case.prefix_lens), list(case.extend_lens)
    seq = [p + n for p, n in zip(prefix, extend, strict=True)]
    bs = len(seq)
    kvh, d, h = case.num_kv_heads, case.head_dim, case.num_heads
    paged = layout == "paged"

    pages_per_req = [-(-s // ps) for s in seq]
    spare = 3 if paged else 0
    num_pages = sum(pages_per_req) + spare
    page_ids = (torch.randperm(num_pages, generator=gen) + 1) if paged else torch.arange(1, num_pages + 1)
    req_slots: list[torch.Tensor] = []
    cursor = 0
    for s, npages in zip(seq, pages_per_req, strict=True):
        pages = page_ids[cursor : cursor + npages]
        cursor += npages
        pos = torch.arange(s)
        req_slots.append(pages[pos // ps] * ps + pos % ps)

    num_layers = case.layer_id + 2
    pool = KVPool(num_pages, ps, num_layers, kvh, d, dtype, torch.device("cpu"))
    total_slots = pool.k_buffers[0].shape[0]
    if paged:  # garbage everywhere a backend must not read or write
        for buf in pool.k_buffers + pool.v_buffers:
            buf.copy_(torch.randn(buf.shape, generator=gen) * 3)

    max_ctx = max(seq) + 7
    rows = bs + 3
    if paged:
        req_to_token = torch.randint(ps, total_slots, (rows, max_ctx), generator=gen)
        req_idx = torch.randperm(rows, generator=gen)[:bs]
    else:
        req_to_token = torch.zeros((rows, max_ctx), dtype=torch.int64)
        req_idx = torch.arange(bs)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    layer_ids = [case.layer_id] if case.global_layer_id is None else [case.layer_id, case.global_layer_id]
    for i in range(bs):
        req_to_token[req_idx[i], : seq[i]] = req_slots[i]
        keys.append((torch.randn((seq[i], kvh, d), generator=gen)).to(dtype))
        values.append((torch.randn((seq[i], kvh, d), generator=gen)).to(dtype))
        for layer_id in layer_ids:
            k_buf, v_buf = pool.get_kv(layer_id)
            k_buf[req_slots[i][: prefix[i]]] = keys[i][: prefix[i]]
            v_buf[req_slots[i][: prefix[i]]] = values[i][: prefix[i]]

    k_new = torch.cat([keys[i][prefix[i] :] for i in range(bs)])
    v_new = torch.cat([values[i][prefix[i] :] for i in range(bs)])
    q = torch.randn((sum(extend), h, d), generator=gen).to(dtype)
    out_cache_loc = torch.cat([req_slots[i][prefix[i] :] for i in range(bs)])
    positions = torch.cat([torch.arange(prefix[i], seq[i]) for i in range(bs)])

    def t(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64)

    pool.device = device
    pool.k_buffers = [b.to(device) for b in pool.k_buffers]
    pool.v_buffers = [b.to(device) for b in pool.v_buffers]
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if case.mode == "decode" else ForwardMode.EXTEND,
        input_ids=torch.randint(0, 1000, (sum(extend),), generator=gen).to(device),
        positions=positions.to(device),
        out_cache_loc=out_cache_loc.to(device),
        req_pool_indices=req_idx.to(torch.int64).to(device),
        seq_lens=t(seq).to(device),
        prefix_lens=t(prefix).to(device),
        extend_lens=t(extend).to(device),
        req_to_token=req_to_token.to(device),
        kv_pool=pool,
        seq_lens_cpu=list(seq),
        prefix_lens_cpu=list(prefix),
        extend_lens_cpu=list(extend),
        logits_indices=(torch.cumsum(t(extend), 0) - 1).to(device),
    )
    layer = AttentionLayerSpec(case.layer_id, h, kvh, d, case.softmax_scale, case.sliding_window, case.logit_softcap)
    global_layer = None
    if case.global_layer_id is not None:
        global_layer = replace(layer, layer_id=case.global_layer_id, sliding_window=None)
    return AttentionInputs(
        case, q.to(device), k_new.to(device), v_new.to(device), layer, batch, keys, values, global_layer
    )


def with_kv_layout(pool: KVPool, layout: KVLayout) -> KVPool:
    """``pool``'s contents laid out as ``layout``: the pool itself when it already
    is, else a copy (token-major ``[slots, kv_heads, d]`` <-> head-major
    ``[pages, kv_heads, page_size, d]``)."""
    if pool.layout == layout:
        return pool
    pages, ps = pool.num_pages + 1, pool.page_size

    def convert(buf: torch.Tensor) -> torch.Tensor:
        if layout.head_major:
            return buf.view(pages, ps, *buf.shape[1:]).transpose(1, 2).contiguous()
        return buf.transpose(1, 2).reshape(pages * ps, buf.shape[1], buf.shape[3])

    out = KVPool.__new__(KVPool)
    out.__dict__.update(pool.__dict__)
    out.layout = layout
    out.k_buffers = [convert(b) for b in pool.k_buffers]
    out.v_buffers = [convert(b) for b in pool.v_buffers]
    return out
