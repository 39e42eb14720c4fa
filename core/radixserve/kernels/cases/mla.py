"""Multi-head latent attention cases: ``MLACase`` (one batch of requests) and
the paged or contiguous inputs over a ``LatentKVPool`` it makes
(``make_mla_inputs``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixserve.cache.memory_pool import LatentKV, LatentKVPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels.mla import MLALayerSpec
from radixserve.kernels.query import KernelQuery


@dataclass(frozen=True)
class MLACase:
    """One MLA batch: request ``i`` has ``prefix_lens[i]`` tokens already in the
    pool and ``extend_lens[i]`` new ones (all 1 in decode)."""

    name: str
    mode: str  # "extend" or "decode"
    page_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    scaling: float | None = None  # None: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
    layer_id: int = 1  # a layer other than 0, in a pool with layer_id + 2 layers

    def __post_init__(self) -> None:
        if self.mode not in ("extend", "decode"):
            raise ValueError(f"mode must be 'extend' or 'decode', got {self.mode!r}")
        if len(self.prefix_lens) != len(self.extend_lens):
            raise ValueError("prefix_lens and extend_lens differ in length")
        if self.mode == "decode" and any(n != 1 for n in self.extend_lens):
            raise ValueError("decode cases have exactly one new token per request")
        if any(n < 1 for n in self.extend_lens):
            raise ValueError("every request needs at least one new token")

    @property
    def softmax_scale(self) -> float:
        return self.scaling if self.scaling is not None else (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    @property
    def latent(self) -> LatentKV:
        return LatentKV(self.kv_lora_rank, self.qk_rope_head_dim)

    def layer(self) -> MLALayerSpec:
        return MLALayerSpec(
            self.layer_id,
            self.num_heads,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.softmax_scale,
        )

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        return KernelQuery(
            device=device,
            dtype=dtype,
            head_dim=self.qk_nope_head_dim + self.qk_rope_head_dim,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            page_size=self.page_size,
            kv_dtype=dtype,
            mla=self.latent,
        )


@dataclass
class MLAInputs:
    """Everything one ``forward_mla`` call needs, plus the logical (unpaged) entries."""

    case: MLACase
    q_nope: torch.Tensor  # [T, H, nope]
    q_rope: torch.Tensor  # [T, H, rope]
    latent: torch.Tensor  # [T, kv_lora_rank] new tokens
    k_rope: torch.Tensor  # [T, rope]
    kv_b_weight: torch.Tensor  # [H, nope + v, kv_lora_rank]
    layer: MLALayerSpec
    batch: ForwardBatch
    # Per request, all seq_len entries [latent ; k_rope] in position order (prefix then new).
    entries: list[torch.Tensor]


def make_mla_inputs(
    case: MLACase,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    layout: str = "paged",
) -> MLAInputs:
    """Random inputs for ``case``: ``layout="paged"`` scatters each request over
    randomly chosen pages (slots permuted, request rows shuffled, unused slots and
    table entries full of garbage); ``"contiguous"`` lays requests out one after
    another from slot ``page_size`` on. Latents are unit-variance (as after their
    RMSNorm) and ``kv_b_weight`` is scaled so that keys and values are too."""
    if layout not in ("paged", "contiguous"):
        raise ValueError(f"layout must be 'paged' or 'contiguous', got {layout!r}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    ps = case.page_size
    prefix, extend = list(case.prefix_lens), list(case.extend_lens)
    seq = [p + n for p, n in zip(prefix, extend, strict=True)]
    bs = len(seq)
    h, rank, nope, rope, v = (
        case.num_heads,
        case.kv_lora_rank,
        case.qk_nope_head_dim,
        case.qk_rope_head_dim,
        case.v_head_dim,
    )
    paged = layout == "paged"

    pages_per_req = [-(-s // ps) for s in seq]
    num_pages = sum(pages_per_req) + (3 if paged else 0)
    page_ids = (torch.randperm(num_pages, generator=gen) + 1) if paged else torch.arange(1, num_pages + 1)
    req_slots: list[torch.Tensor] = []
    cursor = 0
    for s, npages in zip(seq, pages_per_req, strict=True):
        pages = page_ids[cursor : cursor + npages]
        cursor += npages
        pos = torch.arange(s)
        req_slots.append(pages[pos // ps] * ps + pos % ps)

    pool = LatentKVPool(num_pages, ps, case.layer_id + 2, case.latent, dtype, torch.device("cpu"))
    total_slots = pool.latent_buffers[0].shape[0]
    if paged:  # garbage everywhere a backend must not read or write
        for buf in pool.latent_buffers:
            buf.copy_(torch.randn(buf.shape, generator=gen) * 3)

    max_ctx = max(seq) + 7
    rows = bs + 3
    if paged:
        req_to_token = torch.randint(ps, total_slots, (rows, max_ctx), generator=gen)
        req_idx = torch.randperm(rows, generator=gen)[:bs]
    else:
        req_to_token = torch.zeros((rows, max_ctx), dtype=torch.int64)
        req_idx = torch.arange(bs)
    entries: list[torch.Tensor] = []
    for i in range(bs):
        req_to_token[req_idx[i], : seq[i]] = req_slots[i]
        entries.append(torch.randn((seq[i], rank + rope), generator=gen).to(dtype))
        pool.get_latent(case.layer_id)[req_slots[i][: prefix[i]]] = entries[i][: prefix[i]]

    new = torch.cat([entries[i][prefix[i] :] for i in range(bs)])
    tokens = sum(extend)
    q_nope = torch.randn((tokens, h, nope), generator=gen).to(dtype)
    q_rope = torch.randn((tokens, h, rope), generator=gen).to(dtype)
    kv_b_weight = (torch.randn((h, nope + v, rank), generator=gen) / math.sqrt(rank)).to(dtype)
    out_cache_loc = torch.cat([req_slots[i][prefix[i] :] for i in range(bs)])
    positions = torch.cat([torch.arange(prefix[i], seq[i]) for i in range(bs)])

    def t(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64)

    pool.device = device
    pool.latent_buffers = [b.to(device) for b in pool.latent_buffers]
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if case.mode == "decode" else ForwardMode.EXTEND,
        input_ids=torch.randint(0, 1000, (tokens,), generator=gen).to(device),
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
    return MLAInputs(
        case,
        q_nope.to(device),
        q_rope.to(device),
        new[:, :rank].to(device),
        new[:, rank:].to(device),
        kv_b_weight.to(device),
        case.layer(),
        batch,
        entries,
    )
