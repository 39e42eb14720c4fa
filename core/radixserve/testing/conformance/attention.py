"""The attention kit: ``AttentionCase`` and its case sets, the paged or
contiguous inputs (``make_attention_inputs``), the dense float64 statement of
the semantics (``dense_attention``: causal, GQA, sliding windows, logit
soft-capping), the KV store check, ``with_kv_layout`` and
``check_attention_backend``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from radixserve.cache.memory_pool import KVLayout, KVPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import AttentionLayerSpec, KernelQuery
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

    def __post_init__(self):
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


def _decode(name, page_size, heads, kv_heads, head_dim, seq_lens, **kw) -> AttentionCase:
    return AttentionCase(
        name,
        "decode",
        page_size,
        heads,
        kv_heads,
        head_dim,
        tuple(s - 1 for s in seq_lens),
        tuple(1 for _ in seq_lens),
        **kw,
    )


def _extend(name, page_size, heads, kv_heads, head_dim, prefix_lens, extend_lens, **kw) -> AttentionCase:
    return AttentionCase(
        name, "extend", page_size, heads, kv_heads, head_dim, tuple(prefix_lens), tuple(extend_lens), **kw
    )


# Sliding windows (shorter and longer than the context: fresh prompts, cached
# prefixes partly outside the window, a chunk longer than the window after a long
# prefix, decode down to a window of one key) and logit soft-capping (with a
# larger scale in one case, so the cap saturates), alone and together.
_WINDOW_SOFTCAP_EXTEND = _extend(
    "extend/window16+softcap/p16/gqa2/d128", 16, 4, 2, 128, (20, 0), (30, 12), sliding_window=16, logit_softcap=1.5
)
_WINDOW_SOFTCAP_DECODE = _decode(
    "decode/window7+softcap/p1/gqa2/d64", 1, 4, 2, 64, (30, 5, 8), sliding_window=7, logit_softcap=1.0
)
_ATTN_FEATURES = (
    _extend("extend/window8/nocache/p16/gqa2/d64", 16, 4, 2, 64, (0, 0, 0), (5, 30, 17), sliding_window=8),
    _extend("extend/window24/prefix/p16/gqa4/d128", 16, 4, 1, 128, (16, 40, 0), (9, 20, 33), sliding_window=24),
    _extend("extend/window5/chunk/p1/gqa1/d64", 1, 2, 2, 64, (37, 3), (40, 2), sliding_window=5),
    _decode("decode/window20/p16/gqa4/d128", 16, 4, 1, 128, (1, 17, 40, 64, 21), sliding_window=20),
    _decode("decode/window1/p1/gqa1/d64", 1, 2, 2, 64, (9, 1, 26), sliding_window=1),
    _extend("extend/softcap/prefix/p16/gqa2/d64", 16, 4, 2, 64, (16, 0), (9, 13), scaling=0.3, logit_softcap=2.0),
    _decode("decode/softcap/p16/gqa8/d64", 16, 8, 1, 64, (50, 3), logit_softcap=1.5),
    _WINDOW_SOFTCAP_EXTEND,
    _WINDOW_SOFTCAP_DECODE,
)
_ATTN_QUICK = (
    _extend("extend/prefix/p16/gqa2/d64", 16, 4, 2, 64, (16, 0, 21), (9, 13, 1)),
    _extend("extend/ragged/p1/gqa1/d128", 1, 2, 2, 128, (0, 5), (11, 3)),
    _decode("decode/p16/gqa4/d128", 16, 8, 2, 128, (1, 17, 40)),
    _decode("decode/p1/gqa1/d64", 1, 2, 2, 64, (9, 26)),
    _WINDOW_SOFTCAP_EXTEND,
    _WINDOW_SOFTCAP_DECODE,
)
_ATTN_STANDARD = (
    _extend("extend/nocache/p1/gqa1/d64", 1, 4, 4, 64, (0, 0, 0), (5, 17, 1)),
    _extend("extend/prefix/p16/gqa2/d128", 16, 4, 2, 128, (16, 32, 0), (7, 20, 3)),
    _extend("extend/prefix/p1/gqa4/d64", 1, 8, 2, 64, (3, 11), (9, 1), scaling=0.09),
    _extend("extend/midpage/p16/gqa8/d64", 16, 8, 1, 64, (21, 5), (14, 40)),
    _decode("decode/p16/gqa4/d128", 16, 8, 2, 128, (1, 17, 40, 33)),
    _decode("decode/p1/gqa1/d64", 1, 2, 2, 64, (9, 1, 26), scaling=0.2),
    _decode("decode/p16/gqa8/d64", 16, 8, 1, 64, (50, 3)),
) + _ATTN_FEATURES
_ATTN_FULL = _ATTN_STANDARD + (
    _extend("extend/long/p16/gqa4/d128", 16, 16, 4, 128, (128, 0, 37), (100, 300, 64)),
    _extend("extend/many/p1/gqa2/d64", 1, 4, 2, 64, tuple(range(0, 40, 5)), tuple(range(1, 17, 2))),
    _extend("extend/d96/p16/gqa2", 16, 4, 2, 96, (16, 0), (5, 30)),
    _decode("decode/long/p16/gqa4/d128", 16, 16, 4, 128, (700, 1, 129, 2048)),
    _decode("decode/many/p1/gqa1/d128", 1, 4, 4, 128, tuple(range(1, 200, 9))),
    _decode("decode/d256/p16/gqa2", 16, 4, 2, 256, (33, 64)),
    _extend("extend/window64/long/p16/gqa4/d128", 16, 16, 4, 128, (128, 0, 37), (100, 300, 64), sliding_window=64),
    _decode("decode/window256/long/p16/gqa4/d128", 16, 16, 4, 128, (700, 1, 129, 2048), sliding_window=256),
    _decode("decode/window64/many/p1/gqa1/d128", 1, 4, 4, 128, tuple(range(1, 200, 9)), sliding_window=64),
    _decode("decode/softcap/long/p16/gqa2/d256", 16, 4, 2, 256, (700, 2048), scaling=0.2, logit_softcap=30.0),
)
ATTENTION_CASES: dict[str, tuple[AttentionCase, ...]] = {
    "quick": _ATTN_QUICK,
    "standard": _ATTN_STANDARD,
    "full": _ATTN_FULL,
}


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
    req_slots, cursor = [], 0
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
    keys, values = [], []
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
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731

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


def _inputs_on_cpu_fp32(inputs: AttentionInputs) -> AttentionInputs:
    """The same inputs for the reference: CPU, float32 (values already rounded)."""
    b = inputs.batch
    cpu = torch.device("cpu")
    pool = KVPool.__new__(KVPool)
    pool.__dict__.update(b.kv_pool.__dict__)
    pool.dtype, pool.device = torch.float32, cpu
    # copy=True: for float32 on cpu ``.to`` would alias the backend's own pool.
    pool.k_buffers = [x.to(cpu, torch.float32, copy=True) for x in b.kv_pool.k_buffers]
    pool.v_buffers = [x.to(cpu, torch.float32, copy=True) for x in b.kv_pool.v_buffers]
    batch = batch_on_cpu(b, pool)
    f = lambda x: x.to(cpu, torch.float32, copy=True)  # noqa: E731
    return AttentionInputs(
        inputs.case,
        f(inputs.q),
        f(inputs.k),
        f(inputs.v),
        inputs.layer,
        batch,
        [f(x) for x in inputs.keys],
        [f(x) for x in inputs.values],
        inputs.global_layer,
    )


def dense_attention(inputs: AttentionInputs, layer: AttentionLayerSpec | None = None) -> torch.Tensor:
    """Causal GQA attention computed densely in float64 from the logical K/V,
    independent of any paging: the kit's own statement of the semantics. The
    sliding window and logit cap are ``layer``'s (default ``inputs.layer``): a
    query at position p sees keys p - window + 1 .. p, and the scaled scores
    become cap * tanh(scores / cap) before the softmax."""
    case = inputs.case
    layer = layer or inputs.layer
    window, cap = layer.sliding_window, layer.logit_softcap
    group = case.num_heads // case.num_kv_heads
    outs = []
    start = 0
    for i, (p, n) in enumerate(zip(case.prefix_lens, case.extend_lens, strict=True)):
        q = inputs.q[start : start + n].to("cpu", torch.float64)  # [n, H, D]
        start += n
        k = inputs.keys[i].to("cpu", torch.float64).repeat_interleave(group, dim=1)  # [S, H, D]
        v = inputs.values[i].to("cpu", torch.float64).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.softmax_scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(p, p + n)[:, None]
        k_pos = torch.arange(p + n)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs)


def _check_kv_store(inputs: AttentionInputs, before_k, before_v) -> str:
    pool = inputs.batch.kv_pool
    loc = inputs.batch.out_cache_loc.cpu()
    written = {inputs.layer.layer_id} | ({inputs.global_layer.layer_id} if inputs.global_layer else set())
    problems = []
    for layer_id in range(pool.num_layers):
        for name, buffers, before, new in (
            ("K", pool.k_buffers, before_k, inputs.k),
            ("V", pool.v_buffers, before_v, inputs.v),
        ):
            expected = before[layer_id].clone()
            if layer_id in written:
                expected[loc] = new.to("cpu", pool.dtype)
            actual = buffers[layer_id].to("cpu")
            if actual.dtype != expected.dtype or not torch.equal(actual, expected):
                if actual.shape != expected.shape or actual.dtype != expected.dtype:
                    problems.append(f"layer {layer_id} {name} buffer replaced ({actual.dtype} {tuple(actual.shape)})")
                    continue
                wrong = (actual != expected).reshape(actual.shape[0], -1).any(dim=1)
                slots = torch.nonzero(wrong).flatten()
                new_slots = set(loc.tolist()) if layer_id in written else set()
                missing = sum(1 for s in slots.tolist() if s in new_slots)
                stray = len(slots) - missing
                detail = []
                if missing:
                    detail.append(f"{missing} new slots not stored correctly")
                if stray:
                    detail.append(f"{stray} other slots modified")
                problems.append(f"layer {layer_id} {name}: " + ", ".join(detail))
    return "ok" if not problems else "; ".join(problems)


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


def check_attention_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    registry=None,
    *,
    cases: str | Sequence[AttentionCase] = "standard",
    reference: BackendSpec = "torch_native",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run the attention cases on ``backend`` and compare with ``reference``. The
    backend runs on a KV pool in the layout it declares (``kv_layout``). A
    windowed case compares both of its layers' outputs (rows of the windowed
    layer, then of the global one) and checks both layers' stores."""
    run = _Run.resolve("attention", backend, device, dtypes, registry, reference)
    case_list = _cases("attention", cases, ATTENTION_CASES)

    def check_one(case, dtype, query, tol, result, case_seed):
        inputs = make_attention_inputs(case, dtype, run.torch_device, seed=case_seed)
        ref_inputs = _inputs_on_cpu_fp32(inputs)
        before_k = [b.to("cpu", copy=True) for b in inputs.batch.kv_pool.k_buffers]
        before_v = [b.to("cpu", copy=True) for b in inputs.batch.kv_pool.v_buffers]
        # The case's layer, then (windowed cases) a global layer in the same step.
        layers = [inputs.layer] + ([inputs.global_layer] if inputs.global_layer is not None else [])

        ref = run.ref_cls(run.reference_query(query))
        ref.init_forward_metadata(ref_inputs.batch)
        b = ref_inputs.batch
        expected = torch.cat([ref.forward(ref_inputs.q, ref_inputs.k, ref_inputs.v, layer, b) for layer in layers])

        impl = run.cls(query)
        inputs.batch.kv_pool = with_kv_layout(inputs.batch.kv_pool, run.cls.kv_layout)  # the one it declares
        impl.init_forward_metadata(inputs.batch)
        out = torch.cat([impl.forward(inputs.q, inputs.k, inputs.v, layer, inputs.batch) for layer in layers])
        inputs.batch.kv_pool = with_kv_layout(inputs.batch.kv_pool, KVLayout())  # token-major, for the store check
        close = _score(result, out, expected, dtype, tol)
        result.kv_store = _check_kv_store(inputs, before_k, before_v)
        result.passed = close and result.kv_store == "ok"

    return run.check_each(case_list, tolerances, seed, check_one)
