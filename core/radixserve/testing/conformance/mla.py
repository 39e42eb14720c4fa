"""The multi-head latent attention kit: ``MLACase`` and its case sets, the paged
or contiguous inputs over a ``LatentKVPool`` (``make_mla_inputs``), the dense
float64 statement of the semantics (``dense_mla_attention``: the latent
up-projected per head, then causal attention), the latent store check and
``check_mla_attention_backend``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from radixserve.cache.memory_pool import LatentKV, LatentKVPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import KernelQuery, MLALayerSpec
from radixserve.testing.conformance.base import (
    BackendSpec,
    ConformanceReport,
    Tolerances,
    _cases,
    _Run,
    _score,
    batch_on_cpu,
)


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

    def __post_init__(self):
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


def _mla(name, mode, page_size, heads, dims, prefix_lens, extend_lens, **kw) -> MLACase:
    """``dims``: (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""
    return MLACase(name, mode, page_size, heads, *dims, tuple(prefix_lens), tuple(extend_lens), **kw)


def _decode(name, page_size, heads, dims, seq_lens, **kw) -> MLACase:
    return _mla(name, "decode", page_size, heads, dims, [s - 1 for s in seq_lens], [1] * len(seq_lens), **kw)


SMALL = (64, 32, 16, 48)  # a value head wider than the query's nope part, as in the tiny test models
QUARTER = (128, 32, 16, 32)  # V2-Lite's proportions at a quarter of the latent
V2_LITE = (512, 128, 64, 128)  # DeepSeek-V2(-Lite)'s real head shape

_MLA_QUICK = (
    _mla("extend/prefix/p16/h4/small", "extend", 16, 4, SMALL, (16, 0, 21), (9, 13, 1)),
    _mla("extend/ragged/p1/h2/small", "extend", 1, 2, SMALL, (0, 5), (11, 3)),
    _decode("decode/p16/h8/quarter", 16, 8, QUARTER, (1, 17, 40)),
    _decode("decode/p1/h2/small", 1, 2, SMALL, (9, 26)),
)
_MLA_STANDARD = _MLA_QUICK + (
    _mla("extend/nocache/p1/h4/quarter", "extend", 1, 4, QUARTER, (0, 0, 0), (5, 17, 1), scaling=0.09),
    _mla("extend/midpage/p16/h2/small", "extend", 16, 2, SMALL, (21, 5), (14, 40)),
    _decode("decode/p16/h16/v2-lite", 16, 16, V2_LITE, (33, 1, 70)),
    _decode("decode/p1/h4/small", 1, 4, SMALL, (9, 1, 26, 50), scaling=0.2),
)
_MLA_FULL = _MLA_STANDARD + (
    _mla("extend/long/p16/h16/v2-lite", "extend", 16, 16, V2_LITE, (128, 0, 37), (100, 300, 64)),
    _decode("decode/long/p16/h16/v2-lite", 16, 16, V2_LITE, (700, 1, 129, 2048)),
    _decode("decode/many/p1/h16/v2-lite", 1, 16, V2_LITE, tuple(range(1, 200, 9))),
    _decode("decode/h128/p16/v2", 16, 128, V2_LITE, (64, 300)),  # DeepSeek-V2's 128 heads on one rank
)
MLA_CASES: dict[str, tuple[MLACase, ...]] = {"quick": _MLA_QUICK, "standard": _MLA_STANDARD, "full": _MLA_FULL}


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
    req_slots, cursor = [], 0
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
    entries = []
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
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731

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


def _inputs_on_cpu_fp32(inputs: MLAInputs) -> MLAInputs:
    """The same inputs for the reference: CPU, float32 (values already rounded)."""
    b = inputs.batch
    cpu = torch.device("cpu")
    pool = LatentKVPool.__new__(LatentKVPool)
    pool.__dict__.update(b.kv_pool.__dict__)
    pool.dtype, pool.device = torch.float32, cpu
    # copy=True: for float32 on cpu ``.to`` would alias the backend's own pool.
    pool.latent_buffers = [x.to(cpu, torch.float32, copy=True) for x in _pool(inputs).latent_buffers]
    f = lambda x: x.to(cpu, torch.float32, copy=True)  # noqa: E731
    batch = batch_on_cpu(b, pool)
    return MLAInputs(
        inputs.case,
        f(inputs.q_nope),
        f(inputs.q_rope),
        f(inputs.latent),
        f(inputs.k_rope),
        f(inputs.kv_b_weight),
        inputs.layer,
        batch,
        [f(x) for x in inputs.entries],
    )


def _pool(inputs: MLAInputs) -> LatentKVPool:
    pool = inputs.batch.kv_pool
    assert isinstance(pool, LatentKVPool)
    return pool


def dense_mla_attention(inputs: MLAInputs) -> torch.Tensor:
    """Causal multi-head latent attention computed densely in float64 from the
    logical entries, independent of any paging and in the up-projected form:
    per head, keys ``[W_UK c ; k_rope]`` and values ``W_UV c``. The kit's own
    statement of the semantics (radixserve/kernels/mla.py)."""
    case = inputs.case
    rank, nope = case.kv_lora_rank, case.qk_nope_head_dim
    w = inputs.kv_b_weight.to("cpu", torch.float64)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    outs = []
    start = 0
    for i, (p, n) in enumerate(zip(case.prefix_lens, case.extend_lens, strict=True)):
        q = torch.cat((inputs.q_nope[start : start + n], inputs.q_rope[start : start + n]), dim=-1)
        q = q.to("cpu", torch.float64)  # [n, H, nope + rope]
        start += n
        entries = inputs.entries[i].to("cpu", torch.float64)  # [S, rank + rope]
        c, k_rope = entries[:, :rank], entries[:, rank:]
        k = torch.cat((torch.einsum("sl,hnl->shn", c, w_uk), k_rope[:, None].expand(-1, case.num_heads, -1)), -1)
        v = torch.einsum("sl,hvl->shv", c, w_uv)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.softmax_scale
        q_pos = torch.arange(p, p + n)[:, None]
        k_pos = torch.arange(p + n)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khv->qhv", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs)


def _check_latent_store(inputs: MLAInputs, before: list[torch.Tensor]) -> str:
    pool = _pool(inputs)
    loc = inputs.batch.out_cache_loc.cpu()
    new = torch.cat((inputs.latent, inputs.k_rope), dim=-1).to("cpu", pool.dtype)
    problems = []
    for layer_id in range(pool.num_layers):
        expected = before[layer_id].clone()
        if layer_id == inputs.layer.layer_id:
            expected[loc] = new
        actual = pool.latent_buffers[layer_id].to("cpu")
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            problems.append(f"layer {layer_id} buffer replaced ({actual.dtype} {tuple(actual.shape)})")
            continue
        wrong = torch.nonzero((actual != expected).any(dim=1)).flatten().tolist()
        new_slots = set(loc.tolist()) if layer_id == inputs.layer.layer_id else set()
        missing = sum(1 for s in wrong if s in new_slots)
        detail = []
        if missing:
            detail.append(f"{missing} new slots not stored correctly")
        if len(wrong) - missing:
            detail.append(f"{len(wrong) - missing} other slots modified")
        if detail:
            problems.append(f"layer {layer_id} latent: " + ", ".join(detail))
    return "ok" if not problems else "; ".join(problems)


def check_mla_attention_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    registry=None,
    *,
    cases: str | Sequence[MLACase] = "standard",
    reference: BackendSpec = "torch_mla",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run the MLA cases on ``backend`` (an ``MLAAttentionBackend``) and compare
    with ``reference``; also check that the pool holds exactly the new entries
    afterwards (the ``kv_store`` column)."""
    run = _Run.resolve("attention", backend, device, dtypes, registry, reference)
    case_list = _cases("mla attention", cases, MLA_CASES)

    def check_one(case, dtype, query, tol, result, case_seed):
        inputs = make_mla_inputs(case, dtype, run.torch_device, seed=case_seed)
        ref_inputs = _inputs_on_cpu_fp32(inputs)
        before = [b.to("cpu", copy=True) for b in _pool(inputs).latent_buffers]

        ref = run.ref_cls(run.reference_query(query))
        ref.init_forward_metadata(ref_inputs.batch)
        expected = ref.forward_mla(*_args(ref_inputs))

        impl = run.cls(query)
        impl.init_forward_metadata(inputs.batch)
        out = impl.forward_mla(*_args(inputs))
        close = _score(result, out, expected, dtype, tol)
        result.kv_store = _check_latent_store(inputs, before)
        result.passed = close and result.kv_store == "ok"

    return run.check_each(case_list, tolerances, seed, check_one)


def _args(inputs: MLAInputs) -> tuple:
    return (
        inputs.q_nope,
        inputs.q_rope,
        inputs.latent,
        inputs.k_rope,
        inputs.kv_b_weight,
        inputs.layer,
        inputs.batch,
    )
