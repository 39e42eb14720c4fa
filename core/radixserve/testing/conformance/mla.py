"""The multi-head latent attention kit: ``MLACase``'s case sets (the case class
and the paged or contiguous inputs over a ``LatentKVPool``, ``make_mla_inputs``,
live in radixserve/kernels/cases/mla.py, which ``auto``'s timing uses too), the
dense float64 statement of the semantics (``dense_mla_attention``: the latent
up-projected per head, then causal attention), the latent store check and
``check_mla_attention_backend``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from radixserve.cache.memory_pool import LatentKVPool
from radixserve.forward_batch import ForwardBatch
from radixserve.kernels import KernelQuery, MLALayerSpec
from radixserve.kernels.cases.mla import MLACase, MLAInputs, make_mla_inputs
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

MLADims = tuple[int, int, int, int]


def _mla(
    name: str,
    mode: str,
    page_size: int,
    heads: int,
    dims: MLADims,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    **kw: Any,
) -> MLACase:
    """``dims``: (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""
    return MLACase(name, mode, page_size, heads, *dims, tuple(prefix_lens), tuple(extend_lens), **kw)


def _decode(name: str, page_size: int, heads: int, dims: MLADims, seq_lens: Sequence[int], **kw: Any) -> MLACase:
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


def _inputs_on_cpu_fp32(inputs: MLAInputs) -> MLAInputs:
    """The same inputs for the reference: CPU, float32 (values already rounded)."""
    b = inputs.batch
    cpu = torch.device("cpu")
    pool = LatentKVPool.__new__(LatentKVPool)
    pool.__dict__.update(b.kv_pool.__dict__)
    pool.dtype, pool.device = torch.float32, cpu
    # copy=True: for float32 on cpu ``.to`` would alias the backend's own pool.
    pool.latent_buffers = [x.to(cpu, torch.float32, copy=True) for x in _pool(inputs).latent_buffers]

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.to(cpu, torch.float32, copy=True)

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
    registry: PluginRegistry | None = None,
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

    def check_one(
        case: MLACase,
        dtype: torch.dtype,
        query: KernelQuery,
        tol: Tolerance,
        result: CaseResult,
        case_seed: int,
    ) -> None:
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


def _args(
    inputs: MLAInputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, MLALayerSpec, ForwardBatch]:
    return (
        inputs.q_nope,
        inputs.q_rope,
        inputs.latent,
        inputs.k_rope,
        inputs.kv_b_weight,
        inputs.layer,
        inputs.batch,
    )
