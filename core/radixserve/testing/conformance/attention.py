"""The attention kit: ``AttentionCase``'s case sets (the case class, the paged or
contiguous inputs ``make_attention_inputs`` and ``with_kv_layout`` live in
radixserve/kernels/cases/attention.py, which ``auto``'s timing uses too), the
dense float64 statement of the semantics (``dense_attention``: causal, GQA,
sliding windows, logit soft-capping), the KV store check and
``check_attention_backend``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from radixserve.cache.memory_pool import KVLayout, KVPool
from radixserve.kernels import AttentionLayerSpec, KernelQuery
from radixserve.kernels.cases.attention import AttentionCase, AttentionInputs, make_attention_inputs, with_kv_layout
from radixserve.testing.conformance.base import (
    BackendSpec,
    CaseResult,
    ConformanceReport,
    Tolerance,
    Tolerances,
    _cases,
    _Run,
    _score,
    batch_on_cpu,
)

if TYPE_CHECKING:
    from radixserve.registry import PluginRegistry


def _decode(
    name: str, page_size: int, heads: int, kv_heads: int, head_dim: int, seq_lens: Sequence[int], **kw: Any
) -> AttentionCase:
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


def _extend(
    name: str,
    page_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    **kw: Any,
) -> AttentionCase:
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

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.to(cpu, torch.float32, copy=True)

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


def _check_kv_store(inputs: AttentionInputs, before_k: list[torch.Tensor], before_v: list[torch.Tensor]) -> str:
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


def check_attention_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    registry: PluginRegistry | None = None,
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

    def check_one(
        case: AttentionCase,
        dtype: torch.dtype,
        query: KernelQuery,
        tol: Tolerance,
        result: CaseResult,
        case_seed: int,
    ) -> None:
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
