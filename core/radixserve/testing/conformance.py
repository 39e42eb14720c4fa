"""The conformance kit: check any backend against the torch reference in one call.

    from radixserve.testing import check_attention_backend
    check_attention_backend("mybackend", device="cuda").raise_for_failures()

Each ``check_*`` function builds the contract's cases (random paged KV layouts
with permuted slots, page sizes 1 and 16, ragged batches, cached prefixes,
decode, GQA, head dims 64 and 128; several MoE expert counts, top-k and
renormalization settings; GEMM shapes with and without bias; the quantization
lifecycle; RMSNorm with and without the fused residual, rotary NeoX/GPT-J/partial
on views of a fused QKV buffer, SiLU-and-mul), runs the backend on ``device`` for every dtype it claims (asked
through ``unsupported_reasons``) and compares it with the reference backend run
on CPU in float32 on the same (dtype-rounded) inputs. The reference is the
``torch`` plugin's: ``torch_native`` attention, MoE and elementwise, ``torch`` GEMM, resolved
by name through the registry like any backend.

A case passes when every element satisfies ``|out - ref| <= atol + rtol * |ref|``
with the dtype's tolerance (``DEFAULT_TOLERANCES``, overridable). The report
shows ``max_abs = max |out - ref|`` and ``max_rel = max_abs / max |ref|`` per case.
Attention cases also check the KV store: after ``forward`` the pool must hold
exactly the new K/V (in the pool dtype) at ``out_cache_loc`` and be unchanged
everywhere else, in every layer.

Case sets: ``"quick"`` (a few cases, for slow backends such as the Triton
interpreter), ``"standard"`` (the default), ``"full"`` (more shapes, for real
devices), or an explicit sequence of case objects.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.cache.memory_pool import KVLayout, KVPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import AttentionLayerSpec, KernelQuery, MoERouting

DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Against a float32 reference on the same rounded inputs. float32 is strict (no
# TF32): pass ``tolerances={torch.float32: Tolerance(...)}`` to loosen it.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
}

BackendSpec = Union[str, type]
Tolerances = Optional[dict[torch.dtype, Tolerance]]


# ---------------------------------------------------------------------------
# Results


@dataclass
class CaseResult:
    case: str
    dtype: str
    passed: bool
    max_abs: float = float("nan")
    max_rel: float = float("nan")
    atol: float = float("nan")
    rtol: float = float("nan")
    kv_store: str = "-"  # attention only: "ok", or what was wrong
    error: Optional[str] = None  # exception or contract violation

    def describe(self) -> str:
        what = []
        if self.error:
            what.append(self.error)
        if not math.isnan(self.max_abs):
            what.append(f"max_abs={self.max_abs:.3g} max_rel={self.max_rel:.3g} (atol={self.atol:g}, rtol={self.rtol:g})")
        if self.kv_store not in ("-", "ok"):
            what.append(f"kv store: {self.kv_store}")
        return f"{self.case} [{self.dtype}]: " + "; ".join(what)


@dataclass
class SkippedCase:
    case: str
    dtype: str
    reasons: list[str]


@dataclass
class ConformanceReport:
    kind: str
    backend: str
    reference: str
    device: str
    results: list[CaseResult] = field(default_factory=list)
    skipped: list[SkippedCase] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # failures not tied to one case

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    @property
    def ok(self) -> bool:
        return bool(self.results) and not self.failures and not self.problems

    def failing_cases(self) -> list[str]:
        return [f"{r.case} [{r.dtype}]" for r in self.failures]

    def __str__(self) -> str:
        passed = sum(r.passed for r in self.results)
        head = (
            f"{self.kind} backend {self.backend!r} vs {self.reference} on {self.device}: "
            f"{passed}/{len(self.results)} cases passed" + ("" if self.ok else "  ** FAILED **")
        )
        lines = [head]
        if self.results:
            width = max(len("case"), *(len(r.case) for r in self.results))
            kv = self.kind == "attention"
            lines.append(
                f"  {'case':<{width}}  {'dtype':<8}  {'max_abs':>9}  {'max_rel':>9}  {'atol':>8}  {'rtol':>8}  "
                + (f"{'kv_store':<8}  " if kv else "") + "result"
            )
            for r in self.results:
                store = r.kv_store if r.kv_store in ("-", "ok") else "FAIL"
                lines.append(
                    f"  {r.case:<{width}}  {r.dtype:<8}  {_fmt(r.max_abs):>9}  {_fmt(r.max_rel):>9}  "
                    f"{_fmt(r.atol):>8}  {_fmt(r.rtol):>8}  " + (f"{store:<8}  " if kv else "")
                    + ("PASS" if r.passed else "FAIL" + (f": {r.error}" if r.error else ""))
                )
        for r in self.results:
            if r.kv_store not in ("-", "ok"):
                lines.append(f"  kv store {r.case} [{r.dtype}]: {r.kv_store}")
        for s in self.skipped:
            lines.append(f"  skipped {s.case} [{s.dtype}]: {'; '.join(s.reasons)}")
        for p in self.problems:
            lines.append(f"  problem: {p}")
        return "\n".join(lines)

    def raise_for_failures(self) -> "ConformanceReport":
        """Raise ``AssertionError`` naming every failing case; return self when all pass."""
        if self.ok:
            return self
        parts = [f"{self.kind} backend {self.backend!r} failed conformance on {self.device}:"]
        parts += [f"  - {r.describe()}" for r in self.failures]
        parts += [f"  - {p}" for p in self.problems]
        if not self.results and not self.problems:
            parts.append("  - no case ran")
        parts += ["", str(self)]
        raise AssertionError("\n".join(parts))


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[float, float, bool, Optional[str]]:
    """``(max_abs, max_rel, passed, problem)`` for ``out`` against ``ref``."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("nan"), float("nan"), False, f"shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if o.numel() == 0:
        return 0.0, 0.0, True, None
    if not torch.isfinite(o).all():
        bad = int((~torch.isfinite(o)).sum())
        return float("nan"), float("nan"), False, f"{bad} non-finite values in the output"
    diff = (o - r).abs()
    max_abs = float(diff.max())
    max_rel = max_abs / max(float(r.abs().max()), 1e-30)
    passed = bool((diff <= tol.atol + tol.rtol * r.abs()).all())
    return max_abs, max_rel, passed, None


# ---------------------------------------------------------------------------
# Resolution


def _registry(registry):
    if registry is not None:
        return registry
    from radixserve.registry import get_registry

    return get_registry()


def resolve_backend(kind: str, backend: BackendSpec, registry=None) -> tuple[str, type]:
    """A backend class from its registered name (entry points) or the class itself."""
    if isinstance(backend, type):
        return getattr(backend, "name", backend.__name__), backend
    reg = _registry(registry)
    table = reg.candidates[kind]
    cand = table.get(backend)
    if cand is None:
        errors = reg.load_errors()
        note = "".join(f"\n  plugin {n!r} failed to load: {e.splitlines()[-1]}" for n, e in errors.items())
        raise LookupError(f"no {kind} backend named {backend!r}; registered: {sorted(table) or 'none'}{note}")
    return cand.name, cand.cls


def _torch_device(device: str, registry) -> torch.device:
    """The torch device of a registered platform; an unknown or unusable one fails loudly."""
    return _registry(registry).resolve_platform(device)().device()


def _reasons(cls: type, query: KernelQuery) -> list[str]:
    reasons = cls.unsupported_reasons(query)
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        raise TypeError(f"{cls.__name__}.unsupported_reasons must return a list of str, got {reasons!r}")
    return reasons


def _error_text(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}".replace("\n", " ")


def _tolerance(dtype: torch.dtype, tolerances: Tolerances) -> Tolerance:
    if tolerances and dtype in tolerances:
        return tolerances[dtype]
    return DEFAULT_TOLERANCES.get(dtype, Tolerance(atol=2e-2, rtol=2e-2))


def _f32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A float32 copy for the reference (never an alias of the backend's input); None stays None."""
    return None if t is None else t.to(torch.float32, copy=True)


def _score(result: CaseResult, out: Any, expected: torch.Tensor, dtype: torch.dtype, tol: Tolerance) -> bool:
    """Fill ``result``'s error, max_abs and max_rel from ``out`` against ``expected``;
    True when the output has ``dtype`` and is close, with no other problem."""
    if isinstance(out, torch.Tensor) and out.dtype != dtype:
        result.error = f"output dtype {out.dtype} != {dtype}"
    result.max_abs, result.max_rel, close, problem = compare(out, expected, tol)
    result.error = result.error or problem
    return close and result.error is None


# ``check_one(case, dtype, query, tol, result, case_seed)``: one case's body. It
# fills ``result`` (max_abs, max_rel, error, kv_store, passed); an exception it
# raises becomes the case's error.
CaseBody = Callable[[Any, torch.dtype, KernelQuery, Tolerance, CaseResult, int], None]


class _Run:
    """Shared driver: dtype selection from ``unsupported_reasons`` and per-case bookkeeping."""

    def __init__(self, kind, name, cls, ref_name, ref_cls, device, dtypes, registry):
        self.kind = kind
        self.name, self.cls = name, cls
        self.ref_name, self.ref_cls = ref_name, ref_cls
        self.device = device
        self.explicit_dtypes = dtypes is not None
        self.dtypes = tuple(dtypes) if dtypes is not None else DEFAULT_DTYPES
        self.report = ConformanceReport(kind, name, ref_name, device)
        self.torch_device = _torch_device(device, registry)

    @classmethod
    def resolve(cls, kind, backend, device, dtypes, registry, reference) -> "_Run":
        name, impl = resolve_backend(kind, backend, registry)
        ref_name, ref_cls = resolve_backend(kind, reference, registry)
        return cls(kind, name, impl, ref_name, ref_cls, device, dtypes, registry)

    def claimed_dtypes(self, queries: Callable[[torch.dtype], list[KernelQuery]]) -> list[torch.dtype]:
        """The dtypes the backend claims: those for which it accepts at least one
        of the cases' queries (``queries(dtype)``)."""
        out = []
        for dtype in self.dtypes:
            first_reasons: Optional[list[str]] = None
            try:
                for query in queries(dtype):
                    reasons = _reasons(self.cls, query)
                    if not reasons:
                        break
                    first_reasons = first_reasons or reasons
                else:
                    reasons = first_reasons or ["no case to run"]
            except Exception as exc:
                self.report.problems.append(f"unsupported_reasons raised for {_dtype_name(dtype)}: {_error_text(exc)}")
                continue
            if reasons:
                if self.explicit_dtypes:
                    self.report.problems.append(
                        f"asked to check {_dtype_name(dtype)} but the backend rejects it: {'; '.join(reasons)}"
                    )
                else:
                    self.report.skipped.append(SkippedCase("*", _dtype_name(dtype), reasons))
                continue
            out.append(dtype)
        if not out and not self.report.problems:
            self.report.problems.append(
                f"the backend supports none of the dtypes {[_dtype_name(d) for d in self.dtypes]} on {self.device}"
            )
        return out

    def case_supported(self, case_name: str, dtype: torch.dtype, query: KernelQuery) -> bool:
        try:
            reasons = _reasons(self.cls, query)
        except Exception as exc:
            self.report.results.append(CaseResult(case_name, _dtype_name(dtype), False, error=_error_text(exc)))
            return False
        if reasons:
            self.report.skipped.append(SkippedCase(case_name, _dtype_name(dtype), reasons))
            return False
        return True

    def reference_query(self, query: KernelQuery) -> KernelQuery:
        ref_query = replace(query, device="cpu", dtype=torch.float32,
                            kv_dtype=torch.float32 if query.kv_dtype is not None else None)
        reasons = _reasons(self.ref_cls, ref_query)
        if reasons:
            raise RuntimeError(f"reference {self.ref_name!r} cannot serve {ref_query.describe()}: {'; '.join(reasons)}")
        return ref_query

    def check_each(
        self,
        case_list: Sequence[Any],
        tolerances: Tolerances,
        seed: int,
        check_one: CaseBody,
        shared_query: Optional[Callable[[torch.dtype], KernelQuery]] = None,
    ) -> ConformanceReport:
        """Run ``check_one`` on every case for every claimed dtype and return the report.

        Case ``index`` gets the seed ``seed * 1000 + index``. By default each case
        runs under its own ``case.query(device, dtype)``, which must be accepted
        (else the case is skipped), and a dtype is claimed when any case's query is
        accepted. With ``shared_query(dtype)`` every case runs under that one query,
        which alone claims the dtype, and no case is asked again."""
        if shared_query is None:
            claim = lambda dt: [c.query(self.device, dt) for c in case_list]  # noqa: E731
        else:
            claim = lambda dt: [shared_query(dt)]  # noqa: E731
        for dtype in self.claimed_dtypes(claim):
            tol = _tolerance(dtype, tolerances)
            query = None if shared_query is None else shared_query(dtype)
            for index, case in enumerate(case_list):
                if shared_query is None:
                    query = case.query(self.device, dtype)
                    if not self.case_supported(case.name, dtype, query):
                        continue
                result = CaseResult(case.name, _dtype_name(dtype), False, atol=tol.atol, rtol=tol.rtol)
                self.report.results.append(result)
                try:
                    check_one(case, dtype, query, tol, result, seed * 1000 + index)
                except Exception as exc:
                    result.error = _error_text(exc)
        return self.finish()

    def finish(self) -> ConformanceReport:
        if not self.report.results and not self.report.problems:
            self.report.problems.append("every case was skipped: the backend supports none of them")
        return self.report


def _cases(kind: str, cases, table: dict[str, Sequence[Any]]) -> Sequence[Any]:
    if isinstance(cases, str):
        if cases not in table:
            raise ValueError(f"unknown {kind} case set {cases!r}; choose from {sorted(table)} or pass case objects")
        return table[cases]
    return list(cases)


# ---------------------------------------------------------------------------
# Attention


@dataclass(frozen=True)
class AttentionCase:
    """One attention batch: request ``i`` has ``prefix_lens[i]`` tokens already in
    the pool and ``extend_lens[i]`` new ones (all 1 in decode)."""

    name: str
    mode: str  # "extend" or "decode"
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    scaling: Optional[float] = None  # None: head_dim ** -0.5
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
        return self.scaling if self.scaling is not None else self.head_dim ** -0.5

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        return KernelQuery(
            device=device, dtype=dtype, head_dim=self.head_dim, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, page_size=self.page_size, kv_dtype=dtype,
        )


def _decode(name, page_size, heads, kv_heads, head_dim, seq_lens, **kw) -> AttentionCase:
    return AttentionCase(name, "decode", page_size, heads, kv_heads, head_dim,
                         tuple(s - 1 for s in seq_lens), tuple(1 for _ in seq_lens), **kw)


def _extend(name, page_size, heads, kv_heads, head_dim, prefix_lens, extend_lens, **kw) -> AttentionCase:
    return AttentionCase(name, "extend", page_size, heads, kv_heads, head_dim, tuple(prefix_lens), tuple(extend_lens), **kw)


_ATTN_QUICK = (
    _extend("extend/prefix/p16/gqa2/d64", 16, 4, 2, 64, (16, 0, 21), (9, 13, 1)),
    _extend("extend/ragged/p1/gqa1/d128", 1, 2, 2, 128, (0, 5), (11, 3)),
    _decode("decode/p16/gqa4/d128", 16, 8, 2, 128, (1, 17, 40)),
    _decode("decode/p1/gqa1/d64", 1, 2, 2, 64, (9, 26)),
)
_ATTN_STANDARD = (
    _extend("extend/nocache/p1/gqa1/d64", 1, 4, 4, 64, (0, 0, 0), (5, 17, 1)),
    _extend("extend/prefix/p16/gqa2/d128", 16, 4, 2, 128, (16, 32, 0), (7, 20, 3)),
    _extend("extend/prefix/p1/gqa4/d64", 1, 8, 2, 64, (3, 11), (9, 1), scaling=0.09),
    _extend("extend/midpage/p16/gqa8/d64", 16, 8, 1, 64, (21, 5), (14, 40)),
    _decode("decode/p16/gqa4/d128", 16, 8, 2, 128, (1, 17, 40, 33)),
    _decode("decode/p1/gqa1/d64", 1, 2, 2, 64, (9, 1, 26), scaling=0.2),
    _decode("decode/p16/gqa8/d64", 16, 8, 1, 64, (50, 3)),
)
_ATTN_FULL = _ATTN_STANDARD + (
    _extend("extend/long/p16/gqa4/d128", 16, 16, 4, 128, (128, 0, 37), (100, 300, 64)),
    _extend("extend/many/p1/gqa2/d64", 1, 4, 2, 64, tuple(range(0, 40, 5)), tuple(range(1, 17, 2))),
    _extend("extend/d96/p16/gqa2", 16, 4, 2, 96, (16, 0), (5, 30)),
    _decode("decode/long/p16/gqa4/d128", 16, 16, 4, 128, (700, 1, 129, 2048)),
    _decode("decode/many/p1/gqa1/d128", 1, 4, 4, 128, tuple(range(1, 200, 9))),
    _decode("decode/d256/p16/gqa2", 16, 4, 2, 256, (33, 64)),
)
ATTENTION_CASES: dict[str, tuple[AttentionCase, ...]] = {
    "quick": _ATTN_QUICK, "standard": _ATTN_STANDARD, "full": _ATTN_FULL,
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


def make_attention_inputs(
    case: AttentionCase,
    dtype: torch.dtype,
    device: Union[str, torch.device] = "cpu",
    seed: int = 0,
    layout: str = "paged",
) -> AttentionInputs:
    """Random inputs for ``case``: ``layout="paged"`` scatters each request over
    randomly chosen pages (slots permuted, request rows shuffled, unused slots and
    table entries full of garbage); ``"contiguous"`` lays requests out one after
    another from slot ``page_size`` on, in request slot order."""
    if layout not in ("paged", "contiguous"):
        raise ValueError(f"layout must be 'paged' or 'contiguous', got {layout!r}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    ps = case.page_size
    prefix, extend = list(case.prefix_lens), list(case.extend_lens)
    seq = [p + n for p, n in zip(prefix, extend)]
    bs = len(seq)
    kvh, d, h = case.num_kv_heads, case.head_dim, case.num_heads
    paged = layout == "paged"

    pages_per_req = [-(-s // ps) for s in seq]
    spare = 3 if paged else 0
    num_pages = sum(pages_per_req) + spare
    page_ids = (torch.randperm(num_pages, generator=gen) + 1) if paged else torch.arange(1, num_pages + 1)
    req_slots, cursor = [], 0
    for s, npages in zip(seq, pages_per_req):
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
    for i in range(bs):
        req_to_token[req_idx[i], : seq[i]] = req_slots[i]
        keys.append((torch.randn((seq[i], kvh, d), generator=gen)).to(dtype))
        values.append((torch.randn((seq[i], kvh, d), generator=gen)).to(dtype))
        k_buf, v_buf = pool.get_kv(case.layer_id)
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
    layer = AttentionLayerSpec(case.layer_id, h, kvh, d, case.softmax_scale)
    return AttentionInputs(case, q.to(device), k_new.to(device), v_new.to(device), layer, batch, keys, values)


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
    c = lambda x: x.to(cpu, copy=True)  # noqa: E731
    batch = ForwardBatch(
        mode=b.mode, input_ids=c(b.input_ids), positions=c(b.positions), out_cache_loc=c(b.out_cache_loc),
        req_pool_indices=c(b.req_pool_indices), seq_lens=c(b.seq_lens), prefix_lens=c(b.prefix_lens),
        extend_lens=c(b.extend_lens), req_to_token=c(b.req_to_token), kv_pool=pool,
        seq_lens_cpu=list(b.seq_lens_cpu), prefix_lens_cpu=list(b.prefix_lens_cpu),
        extend_lens_cpu=list(b.extend_lens_cpu),
        logits_indices=None if b.logits_indices is None else c(b.logits_indices),
    )
    f = lambda x: x.to(cpu, torch.float32, copy=True)  # noqa: E731
    return AttentionInputs(inputs.case, f(inputs.q), f(inputs.k), f(inputs.v), inputs.layer, batch,
                           [f(x) for x in inputs.keys], [f(x) for x in inputs.values])


def dense_attention(inputs: AttentionInputs) -> torch.Tensor:
    """Causal GQA attention computed densely in float64 from the logical K/V,
    independent of any paging: the kit's own statement of the semantics."""
    case = inputs.case
    group = case.num_heads // case.num_kv_heads
    outs = []
    start = 0
    for i, (p, n) in enumerate(zip(case.prefix_lens, case.extend_lens)):
        q = inputs.q[start : start + n].to("cpu", torch.float64)  # [n, H, D]
        start += n
        k = inputs.keys[i].to("cpu", torch.float64).repeat_interleave(group, dim=1)  # [S, H, D]
        v = inputs.values[i].to("cpu", torch.float64).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.softmax_scale
        q_pos = torch.arange(p, p + n)[:, None]
        k_pos = torch.arange(p + n)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs)


def _check_kv_store(inputs: AttentionInputs, before_k, before_v) -> str:
    pool = inputs.batch.kv_pool
    loc = inputs.batch.out_cache_loc.cpu()
    problems = []
    for layer_id in range(pool.num_layers):
        for name, buffers, before, new in (("K", pool.k_buffers, before_k, inputs.k), ("V", pool.v_buffers, before_v, inputs.v)):
            expected = before[layer_id].clone()
            if layer_id == inputs.layer.layer_id:
                expected[loc] = new.to("cpu", pool.dtype)
            actual = buffers[layer_id].to("cpu")
            if actual.dtype != expected.dtype or not torch.equal(actual, expected):
                if actual.shape != expected.shape or actual.dtype != expected.dtype:
                    problems.append(f"layer {layer_id} {name} buffer replaced ({actual.dtype} {tuple(actual.shape)})")
                    continue
                wrong = (actual != expected).reshape(actual.shape[0], -1).any(dim=1)
                slots = torch.nonzero(wrong).flatten()
                new_slots = set(loc.tolist()) if layer_id == inputs.layer.layer_id else set()
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
    dtypes: Optional[Iterable[torch.dtype]] = None,
    registry=None,
    *,
    cases: Union[str, Sequence[AttentionCase]] = "standard",
    reference: BackendSpec = "torch_native",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run the attention cases on ``backend`` and compare with ``reference``. The
    backend runs on a KV pool in the layout it declares (``kv_layout``)."""
    run = _Run.resolve("attention", backend, device, dtypes, registry, reference)
    case_list = _cases("attention", cases, ATTENTION_CASES)

    def check_one(case, dtype, query, tol, result, case_seed):
        inputs = make_attention_inputs(case, dtype, run.torch_device, seed=case_seed)
        ref_inputs = _inputs_on_cpu_fp32(inputs)
        before_k = [b.to("cpu", copy=True) for b in inputs.batch.kv_pool.k_buffers]
        before_v = [b.to("cpu", copy=True) for b in inputs.batch.kv_pool.v_buffers]

        ref = run.ref_cls(run.reference_query(query))
        ref.init_forward_metadata(ref_inputs.batch)
        expected = ref.forward(ref_inputs.q, ref_inputs.k, ref_inputs.v, ref_inputs.layer, ref_inputs.batch)

        impl = run.cls(query)
        inputs.batch.kv_pool = with_kv_layout(inputs.batch.kv_pool, run.cls.kv_layout)  # the one it declares
        impl.init_forward_metadata(inputs.batch)
        out = impl.forward(inputs.q, inputs.k, inputs.v, inputs.layer, inputs.batch)
        inputs.batch.kv_pool = with_kv_layout(inputs.batch.kv_pool, KVLayout())  # token-major, for the store check
        close = _score(result, out, expected, dtype, tol)
        result.kv_store = _check_kv_store(inputs, before_k, before_v)
        result.passed = close and result.kv_store == "ok"

    return run.check_each(case_list, tolerances, seed, check_one)


# ---------------------------------------------------------------------------
# MoE


@dataclass(frozen=True)
class MoECase:
    name: str
    num_tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    renormalize: bool

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        return KernelQuery(device=device, dtype=dtype, num_experts=self.num_experts, top_k=self.top_k)


_MOE_QUICK = (
    MoECase("E8/k2/renorm/T13", 13, 64, 96, 8, 2, True),
    MoECase("E8/k2/plain/T7", 7, 64, 96, 8, 2, False),
    MoECase("E4/k1/plain/T1", 1, 48, 80, 4, 1, False),
)
_MOE_STANDARD = _MOE_QUICK + (
    MoECase("E16/k4/renorm/T32", 32, 128, 64, 16, 4, True),
    MoECase("E4/k4/all-experts/T5", 5, 80, 56, 4, 4, False),
    MoECase("E8/k1/renorm/T9", 9, 64, 128, 8, 1, True),
)
_MOE_FULL = _MOE_STANDARD + (
    MoECase("E64/k6/renorm/T200", 200, 256, 192, 64, 6, True),
    MoECase("E32/k8/plain/T77", 77, 512, 320, 32, 8, False),
)
MOE_CASES: dict[str, tuple[MoECase, ...]] = {"quick": _MOE_QUICK, "standard": _MOE_STANDARD, "full": _MOE_FULL}


def make_moe_inputs(case: MoECase, dtype: torch.dtype, seed: int = 0):
    """``(hidden, router_logits, w13, w2, routing)`` on CPU. Router logits are
    distinct multiples of 0.5 per token, exact in every dtype, so top-k has no ties."""
    gen = torch.Generator().manual_seed(seed)
    t, h, i, e = case.num_tokens, case.hidden, case.intermediate, case.num_experts
    hidden = torch.randn((t, h), generator=gen).to(dtype)
    logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).float() * 0.5
    logits = (logits - logits.mean(dim=1, keepdim=True).round()).to(dtype)
    w13 = (torch.randn((e, 2 * i, h), generator=gen) / math.sqrt(h)).to(dtype)
    w2 = (torch.randn((e, h, i), generator=gen) / math.sqrt(i)).to(dtype)
    return hidden, logits, w13, w2, MoERouting(top_k=case.top_k, renormalize=case.renormalize)


def check_moe_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Optional[Iterable[torch.dtype]] = None,
    registry=None,
    *,
    cases: Union[str, Sequence[MoECase]] = "standard",
    reference: BackendSpec = "torch_native",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run the MoE cases (expert counts, top-k, renormalization) on ``backend``."""
    run = _Run.resolve("moe", backend, device, dtypes, registry, reference)
    case_list = _cases("moe", cases, MOE_CASES)

    def check_one(case, dtype, query, tol, result, case_seed):
        hidden, logits, w13, w2, routing = make_moe_inputs(case, dtype, seed=case_seed)
        ref = run.ref_cls(run.reference_query(query))
        expected = ref.forward(_f32(hidden), _f32(logits), _f32(w13), _f32(w2), routing)
        dev = run.torch_device
        impl = run.cls(query)
        out = impl.forward(hidden.to(dev), logits.to(dev), w13.to(dev), w2.to(dev), routing)
        result.passed = _score(result, out, expected, dtype, tol)

    return run.check_each(case_list, tolerances, seed, check_one)


# ---------------------------------------------------------------------------
# GEMM


@dataclass(frozen=True)
class GemmCase:
    name: str
    batch_shape: tuple[int, ...]  # leading dims of x
    in_features: int
    out_features: int
    bias: bool
    # ``linear_silu_and_mul``: silu(gate) * up of the output's halves, fused; a backend
    # that returns None for it (no such kernel) has the case skipped.
    silu_and_mul: bool = False

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        return KernelQuery(device=device, dtype=dtype)


_GEMM_QUICK = (
    GemmCase("M1/K64/N128", (1,), 64, 128, False),
    GemmCase("M7/K96/N48/bias", (7,), 96, 48, True),
    GemmCase("3d/M33/K128/N80", (3, 11), 128, 80, False),
)
_GEMM_STANDARD = _GEMM_QUICK + (
    GemmCase("M64/K256/N256/bias", (64,), 256, 256, True),
    GemmCase("M5/K40/N24", (5,), 40, 24, False),
    GemmCase("M7/K96/N96/bias/silu_and_mul", (7,), 96, 96, True, silu_and_mul=True),
    GemmCase("3d/M2x9/K64/N128/silu_and_mul", (2, 9), 64, 128, False, silu_and_mul=True),
)
_GEMM_FULL = _GEMM_STANDARD + (
    GemmCase("M512/K1024/N768/bias", (512,), 1024, 768, True),
    GemmCase("3d/M3x7/K4096/N64", (3, 7), 4096, 64, False),
    GemmCase("M300/K512/N1408/bias/silu_and_mul", (300,), 512, 1408, True, silu_and_mul=True),
)
GEMM_CASES: dict[str, tuple[GemmCase, ...]] = {"quick": _GEMM_QUICK, "standard": _GEMM_STANDARD, "full": _GEMM_FULL}


def _gemm_inputs(case: GemmCase, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((*case.batch_shape, case.in_features), generator=gen).to(dtype)
    w = (torch.randn((case.out_features, case.in_features), generator=gen) / math.sqrt(case.in_features)).to(dtype)
    b = torch.randn((case.out_features,), generator=gen).to(dtype) if case.bias else None
    return x, w, b


def check_gemm_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Optional[Iterable[torch.dtype]] = None,
    registry=None,
    *,
    cases: Union[str, Sequence[GemmCase]] = "standard",
    reference: BackendSpec = "torch",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run ``linear`` on several shapes (1-3D inputs, with and without bias), with
    the weight as the backend's ``prepare_weight`` leaves it, and
    ``linear_silu_and_mul`` where the backend has it."""
    run = _Run.resolve("gemm", backend, device, dtypes, registry, reference)
    case_list = _cases("gemm", cases, GEMM_CASES)

    def check_one(case, dtype, query, tol, result, case_seed):
        x, w, b = _gemm_inputs(case, dtype, case_seed)
        ref = run.ref_cls(run.reference_query(query))
        expected = ref.linear(_f32(x), _f32(w), _f32(b))
        dev = run.torch_device
        impl = run.cls(query)
        args = (x.to(dev), impl.prepare_weight(w.to(dev)), None if b is None else b.to(dev))
        if not case.silu_and_mul:
            result.passed = _score(result, impl.linear(*args), expected, dtype, tol)
            return
        out = impl.linear_silu_and_mul(*args)
        if out is None:
            run.report.results.remove(result)
            run.report.skipped.append(SkippedCase(case.name, _dtype_name(dtype), ["no fused linear_silu_and_mul"]))
            return
        gate, up = expected.chunk(2, dim=-1)
        result.passed = _score(result, out, F.silu(gate) * up, dtype, tol)

    return run.check_each(case_list, tolerances, seed, check_one)


# ---------------------------------------------------------------------------
# Elementwise (RMSNorm + residual, rotary, SiLU-and-mul)

ELEMENTWISE_OPS = ("rms_norm", "rotary", "silu_and_mul")


@dataclass(frozen=True)
class ElementwiseCase:
    """One call of an elementwise op on ``num_tokens`` rows.

    ``rms_norm``: ``hidden`` wide, with or without ``residual``; ``heads > 0``
    normalises per head (``x`` a strided ``[T, heads, hidden]`` view, as the q/k
    norms of Qwen3 see it). ``rotary``: q ``[T, heads, head_dim]`` and k
    ``[T, kv_heads, head_dim]``, ``rotary_dim`` (0: all of head_dim), NeoX or
    GPT-J pairs; ``strided`` makes q and k views of one fused QKV buffer (whose
    v part must stay untouched). ``silu_and_mul``: ``hidden`` is ``I``, the
    input ``[*lead, 2I]``."""

    name: str
    op: str
    num_tokens: int
    hidden: int = 0
    residual: bool = False
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    rotary_dim: int = 0
    neox_style: bool = True
    strided: bool = False
    eps: float = 1e-6
    lead: tuple[int, ...] = ()  # silu_and_mul: extra leading dims before the tokens

    def __post_init__(self):
        if self.op not in ELEMENTWISE_OPS:
            raise ValueError(f"op must be one of {ELEMENTWISE_OPS}, got {self.op!r}")
        if self.op == "rotary" and (self.rot_dim % 2 or self.rot_dim > self.head_dim):
            raise ValueError(f"rotary_dim {self.rot_dim} must be even and at most head_dim {self.head_dim}")

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        head_dim = self.head_dim if self.op == "rotary" else None
        return KernelQuery(device=device, dtype=dtype, head_dim=head_dim)


def _norm(name, tokens, hidden, **kw) -> ElementwiseCase:
    return ElementwiseCase(name, "rms_norm", tokens, hidden=hidden, **kw)


def _rope(name, tokens, heads, kv_heads, head_dim, **kw) -> ElementwiseCase:
    return ElementwiseCase(name, "rotary", tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, **kw)


def _silu(name, tokens, inter, **kw) -> ElementwiseCase:
    return ElementwiseCase(name, "silu_and_mul", tokens, hidden=inter, **kw)


_ELEM_QUICK = (
    _norm("rms_norm/T3/H64", 3, 64),
    _norm("rms_norm/residual/T5/H1000", 5, 1000, residual=True, eps=1e-5),
    _norm("rms_norm/residual/T2/H10000", 2, 10000, residual=True),  # longer than one block of the Triton kernel
    _norm("rms_norm/per-head/T4/4x128", 4, 128, heads=4),
    _rope("rotary/neox/d128/qkv-view/T6", 6, 4, 2, 128, strided=True),
    _rope("rotary/gptj/d64/T3", 3, 2, 1, 64, neox_style=False),
    _rope("rotary/neox/d64/partial32/T4", 4, 3, 1, 64, rotary_dim=32, strided=True),
    _silu("silu_and_mul/T3/I96", 3, 96),
    _silu("silu_and_mul/T5/I1000", 5, 1000),
)
_ELEM_STANDARD = _ELEM_QUICK + (
    _norm("rms_norm/T1/H4096", 1, 4096),
    _norm("rms_norm/residual/T300/H4096", 300, 4096, residual=True),
    _norm("rms_norm/residual/T1/H64", 1, 64, residual=True),
    _norm("rms_norm/T257/H777", 257, 777, eps=1e-5),
    _norm("rms_norm/per-head/T300/8x64", 300, 64, heads=8),
    _rope("rotary/neox/d128/qkv-view/T300", 300, 8, 2, 128, strided=True),
    _rope("rotary/gptj/d128/T257", 257, 4, 4, 128, neox_style=False),
    _rope("rotary/neox/d64/T1", 1, 16, 8, 64),
    _rope("rotary/gptj/d128/partial64/qkv-view/T9", 9, 4, 2, 128, rotary_dim=64, neox_style=False, strided=True),
    _silu("silu_and_mul/T1/I4096", 1, 4096),
    _silu("silu_and_mul/T300/I1376", 300, 1376),
    _silu("silu_and_mul/3d/2x7/I80", 7, 80, lead=(2,)),
)
_ELEM_FULL = _ELEM_STANDARD + (
    _norm("rms_norm/residual/T2048/H8192", 2048, 8192, residual=True),
    _norm("rms_norm/residual/T64/H16384", 64, 16384, residual=True),
    _rope("rotary/neox/d128/qkv-view/T4096", 4096, 32, 8, 128, strided=True),
    _silu("silu_and_mul/T2048/I14336", 2048, 14336),
)
ELEMENTWISE_CASES: dict[str, tuple[ElementwiseCase, ...]] = {
    "quick": _ELEM_QUICK, "standard": _ELEM_STANDARD, "full": _ELEM_FULL,
}

_MAX_POSITIONS = 4096  # rows of the rotary cases' cos/sin table


def make_elementwise_inputs(
    case: ElementwiseCase,
    dtype: torch.dtype,
    device: Union[str, torch.device] = "cpu",
    seed: int = 0,
    as_dtype: Optional[torch.dtype] = None,
) -> dict[str, Any]:
    """The op's inputs, drawn on CPU and rounded to ``dtype``, then put on
    ``device`` as ``as_dtype`` (default ``dtype``; the reference gets float32).
    ``rms_norm``: ``x`` (a view of ``buffer``), ``weight``, ``residual`` (or
    None); ``rotary``: ``q``, ``k`` (views of ``buffer`` when strided, else
    ``buffer`` is None), ``positions`` (unsorted, with repeats) and
    ``cos_sin_cache`` (built by :func:`radixserve.layers.rotary.rope_cos_sin_cache`,
    theta 10000); ``silu_and_mul``: ``x``."""
    from radixserve.layers.rotary import rope_cos_sin_cache

    gen = torch.Generator().manual_seed(seed)
    t, device = case.num_tokens, torch.device(device)

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device, as_dtype or dtype) if x.is_floating_point() else x.to(device)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return put((torch.randn(shape, generator=gen) * scale).to(dtype))

    if case.op == "rms_norm":
        if case.heads:  # per head: x is the first heads*hidden columns of a wider row
            buffer = randn(t, (case.heads + 2) * case.hidden)
            x = buffer[:, : case.heads * case.hidden].view(t, case.heads, case.hidden)
        else:
            buffer = x = randn(t, case.hidden, scale=2.0)
        weight = put((1 + 0.1 * torch.randn(case.hidden, generator=gen)).to(dtype))
        residual = randn(*x.shape, scale=2.0) if case.residual else None
        return {"buffer": buffer, "x": x, "weight": weight, "residual": residual}
    if case.op == "rotary":
        d, h, kvh = case.head_dim, case.heads, case.kv_heads
        if case.strided:
            buffer = randn(t, (h + 2 * kvh) * d)
            q, k = buffer[:, : h * d].view(t, h, d), buffer[:, h * d : (h + kvh) * d].view(t, kvh, d)
        else:
            buffer, q, k = None, randn(t, h, d), randn(t, kvh, d)
        positions = torch.randint(0, _MAX_POSITIONS, (t,), generator=gen)
        positions[t // 2 :: 3] = positions[0]  # repeats, as the n>1 choices of one prompt have
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, case.rot_dim, 2, dtype=torch.float32) / case.rot_dim))
        cache = rope_cos_sin_cache(inv_freq, 1.0, _MAX_POSITIONS, dtype)
        return {"buffer": buffer, "q": q, "k": k, "positions": put(positions), "cos_sin_cache": put(cache)}
    return {"x": randn(*case.lead, t, 2 * case.hidden, scale=2.0)}


def run_elementwise_case(backend: Any, case: ElementwiseCase, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Call the op; return what it produced, by name. A broken contract raises."""
    if case.op == "rms_norm":
        if case.residual:
            out, residual = backend.rms_norm(inputs["x"], inputs["weight"], case.eps, inputs["residual"])
            return {"out": out, "residual": residual}
        before = inputs["buffer"].clone()
        out = backend.rms_norm(inputs["x"], inputs["weight"], case.eps)
        if not torch.equal(inputs["buffer"], before):
            raise AssertionError("rms_norm without a residual modified its input")
        return {"out": out}
    if case.op == "rotary":
        result = backend.apply_rotary(inputs["q"], inputs["k"], inputs["positions"], inputs["cos_sin_cache"],
                                      case.neox_style)
        if result is not None:
            raise AssertionError(f"apply_rotary returned a {type(result).__name__}; it works in place")
        if inputs["buffer"] is not None:  # q, k and the v that must stay untouched, all in one
            return {"qkv": inputs["buffer"]}
        return {"q": inputs["q"], "k": inputs["k"]}
    return {"out": backend.silu_and_mul(inputs["x"])}


def check_elementwise_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Optional[Iterable[torch.dtype]] = None,
    registry=None,
    *,
    cases: Union[str, Sequence[ElementwiseCase]] = "standard",
    reference: BackendSpec = "torch_native",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run ``rms_norm`` (with and without the fused residual, per head on a
    strided view), ``apply_rotary`` (NeoX and GPT-J, head dims 64 and 128,
    partial, on views of a fused QKV buffer) and ``silu_and_mul`` on
    ``backend``. Every output is compared (both of ``rms_norm`` with a
    residual; the whole QKV buffer after rotary, so v must be untouched);
    ``rms_norm`` without a residual must leave its input alone."""
    run = _Run.resolve("elementwise", backend, device, dtypes, registry, reference)
    case_list = _cases("elementwise", cases, ELEMENTWISE_CASES)

    def check_one(case, dtype, query, tol, result, case_seed):
        ref_inputs = make_elementwise_inputs(case, dtype, "cpu", case_seed, as_dtype=torch.float32)
        expected = run_elementwise_case(run.ref_cls(run.reference_query(query)), case, ref_inputs)
        inputs = make_elementwise_inputs(case, dtype, run.torch_device, case_seed)
        outputs = run_elementwise_case(run.cls(query), case, inputs)
        parts = []
        for name, want in expected.items():  # every output; the case reports the worst
            part = CaseResult(case.name, result.dtype, False)
            part.passed = _score(part, outputs[name], want, dtype, tol)
            parts.append(part)
            if part.error:
                result.error = result.error or f"{name}: {part.error}"
        measured = [p for p in parts if not math.isnan(p.max_abs)]
        if measured:
            result.max_abs = max(p.max_abs for p in measured)
            result.max_rel = max(p.max_rel for p in measured)
        result.passed = all(p.passed for p in parts) and result.error is None

    return run.check_each(case_list, tolerances, seed, check_one)


# ---------------------------------------------------------------------------
# Quantization


def _dense_semantics(weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _int8_semantics(weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Symmetric per-output-channel int8 weights (scale = max|w| / 127), round half to even."""
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(weight / scale[:, None]), -127, 127)
    return F.linear(x, q * scale[:, None], bias)


def _fp8_semantics(per_channel_weight: bool):
    """w8a8 float8 e4m3: weights scaled per output channel (or per tensor), activations
    per token, ``scale = max|t| / 448``, values clamped to +-448 and rounded to e4m3
    (nearest even), product of the dequantized values. An all-zero token or matrix
    gets ``max|t| = 1e-12``."""

    def e4m3(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``e4m3(clamp(t / scale))`` as float32. The quotient is taken in float64
        and rounded once to float32, which is the correctly rounded float32
        division on any device: on an H100 machine (torch 2.11) this reference
        computed on the CPU came out one e4m3 step from the same reference on the
        GPU, whose result the implementation matched."""
        quotient = (t.double() / scale.double()).float()
        return quotient.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)

    def semantics(weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        w_max = weight.abs().amax(dim=1, keepdim=True) if per_channel_weight else weight.abs().amax()
        w_scale = w_max.clamp(min=1e-12) / 448.0
        x_scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
        return F.linear(e4m3(x, x_scale) * x_scale, e4m3(weight, w_scale) * w_scale, bias)

    return semantics


QuantReference = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]

# The reference semantics of the methods the core documents, in float32:
# ``f(weight, x, bias) -> y`` from the float checkpoint weight. ``fp8`` and
# ``fp8_per_tensor`` are the CUDA plugin's w8a8 methods.
QUANT_REFERENCES: dict[str, QuantReference] = {
    "none": _dense_semantics,
    "int8": _int8_semantics,
    "fp8": _fp8_semantics(per_channel_weight=True),
    "fp8_per_tensor": _fp8_semantics(per_channel_weight=False),
}


@dataclass(frozen=True)
class QuantCase:
    name: str
    batch_shape: tuple[int, ...]
    in_features: int
    out_features: int
    bias: bool
    zero_token: bool = False  # the first input row is all zeros (padding; dynamic activation scales)


_QUANT_QUICK = (
    QuantCase("M4/K64/N96/bias", (4,), 64, 96, True),
    QuantCase("3d/M2x5/K128/N32", (2, 5), 128, 32, False),
)
_QUANT_STANDARD = _QUANT_QUICK + (
    QuantCase("M1/K256/N64", (1,), 256, 64, False),
    QuantCase("M6/K64/N32/bias/zero-token", (6,), 64, 32, True, zero_token=True),
)
QUANT_CASES: dict[str, tuple[QuantCase, ...]] = {"quick": _QUANT_QUICK, "standard": _QUANT_STANDARD, "full": _QUANT_STANDARD}


def _quant_inputs(case: QuantCase, dtype: torch.dtype, seed: int):
    """``(weight, x, bias)``: the float checkpoint weight, the input and the optional bias."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn((case.out_features, case.in_features), generator=gen) / math.sqrt(case.in_features)).to(dtype)
    x = torch.randn((*case.batch_shape, case.in_features), generator=gen).to(dtype)
    if case.zero_token:
        x.view(-1, case.in_features)[0] = 0
    bias = torch.randn((case.out_features,), generator=gen).to(dtype) if case.bias else None
    return weight, x, bias


def check_quantization_method(
    method: BackendSpec,
    device: str = "cpu",
    dtypes: Optional[Iterable[torch.dtype]] = None,
    registry=None,
    *,
    gemm: BackendSpec = "torch",
    reference: Optional[QuantReference] = None,
    cases: Union[str, Sequence[QuantCase]] = "standard",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Drive the lifecycle (``create_weights`` -> load through each parameter's
    ``weight_loader`` -> ``process_weights_after_loading`` -> ``apply``) and compare
    with the method's reference semantics (``QUANT_REFERENCES`` by name, or
    ``reference``) computed in float32 from the float checkpoint weight.

    The kit loads one float checkpoint tensor named ``weight`` (quantizing at load
    time, as ``none`` and ``int8`` do); a method whose parameters need other
    checkpoint tensors fails with a message saying so."""
    name, cls = resolve_backend("quantization", method, registry)
    _, gemm_cls = resolve_backend("gemm", gemm, registry)
    semantics = reference or QUANT_REFERENCES.get(name)
    ref_label = "the given reference" if reference else (f"{name} semantics" if semantics else "no reference")
    run = _Run("quantization", name, cls, ref_label, None, device, dtypes, registry)
    report = run.report
    if semantics is None:
        report.problems.append(
            f"no reference semantics known for quantization method {name!r}: pass reference=f(weight, x, bias)"
        )
        return report
    case_list = _cases("quantization", cases, QUANT_CASES)

    def check_one(case, dtype, query, tol, result, case_seed):
        weight, x, bias = _quant_inputs(case, dtype, case_seed)
        expected = semantics(_f32(weight), _f32(x), _f32(bias))

        gemm_reasons = _reasons(gemm_cls, query)
        if gemm_reasons:
            raise RuntimeError(f"gemm backend {gemm!r} cannot serve {query.describe()}: {'; '.join(gemm_reasons)}")
        impl = cls(query, gemm_cls(query))
        layer = nn.Module()

        def loader(param: nn.Parameter, tensor: torch.Tensor) -> None:
            param.data.copy_(tensor)

        with torch.device(run.torch_device):
            impl.create_weights(layer, case.in_features, case.out_features, dtype, loader)
        params = dict(layer.named_parameters())
        if not params:
            raise AssertionError("create_weights registered no parameters")
        for pname, param in params.items():
            param_loader = getattr(param, "weight_loader", None)
            if param_loader is None:
                raise AssertionError(f"parameter {pname!r} has no weight_loader attribute")
            if pname != "weight":
                raise AssertionError(
                    f"parameter {pname!r} needs a checkpoint tensor the kit does not know how to make; "
                    "the kit loads only a float 'weight'"
                )
            param_loader(param, weight.to(run.torch_device))
        impl.process_weights_after_loading(layer)
        out = impl.apply(layer, x.to(run.torch_device), None if bias is None else bias.to(run.torch_device))
        result.passed = _score(result, out, expected, dtype, tol)

    return run.check_each(
        case_list, tolerances, seed, check_one,
        shared_query=lambda dt: KernelQuery(device=device, dtype=dt, quantization=name),
    )


__all__ = [
    "ATTENTION_CASES",
    "AttentionCase",
    "AttentionInputs",
    "CaseResult",
    "ConformanceReport",
    "DEFAULT_DTYPES",
    "DEFAULT_TOLERANCES",
    "ELEMENTWISE_CASES",
    "ElementwiseCase",
    "GEMM_CASES",
    "GemmCase",
    "MOE_CASES",
    "MoECase",
    "QUANT_CASES",
    "QUANT_REFERENCES",
    "QuantCase",
    "SkippedCase",
    "Tolerance",
    "check_attention_backend",
    "check_elementwise_backend",
    "check_gemm_backend",
    "check_moe_backend",
    "check_quantization_method",
    "compare",
    "dense_attention",
    "make_attention_inputs",
    "make_elementwise_inputs",
    "make_moe_inputs",
    "resolve_backend",
    "run_elementwise_case",
    "with_kv_layout",
]
