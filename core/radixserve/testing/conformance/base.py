"""What every kit has in common: tolerances, the case results and the report,
``compare``, backend resolution and the shared driver (``_Run``) that picks the
dtypes a backend claims and runs each case. The kits (attention.py, mla.py,
moe.py, lora.py, gemm.py, elementwise.py, quantization.py) import this module and nothing
else of the kit; the case classes and input builders they share with ``auto``'s
timing come from radixserve.kernels.cases."""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.kernels import KernelQuery

if TYPE_CHECKING:
    from radixserve.registry import PluginRegistry

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

BackendSpec = str | type
Tolerances = dict[torch.dtype, Tolerance] | None
C = TypeVar("C")  # a case class


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
    error: str | None = None  # exception or contract violation

    def describe(self) -> str:
        what = []
        if self.error:
            what.append(self.error)
        if not math.isnan(self.max_abs):
            what.append(
                f"max_abs={self.max_abs:.3g} max_rel={self.max_rel:.3g} (atol={self.atol:g}, rtol={self.rtol:g})"
            )
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

    @property
    def num_run(self) -> int:
        """The (case, dtype) pairs the backend ran, passed or failed; those it declined are in ``skipped``."""
        return len(self.results)

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
                + (f"{'kv_store':<8}  " if kv else "")
                + "result"
            )
            for r in self.results:
                store = r.kv_store if r.kv_store in ("-", "ok") else "FAIL"
                lines.append(
                    f"  {r.case:<{width}}  {r.dtype:<8}  {_fmt(r.max_abs):>9}  {_fmt(r.max_rel):>9}  "
                    f"{_fmt(r.atol):>8}  {_fmt(r.rtol):>8}  "
                    + (f"{store:<8}  " if kv else "")
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

    def raise_for_failures(self, min_run: int = 0) -> ConformanceReport:
        """Raise ``AssertionError`` naming every failing case, or saying how few ran
        when fewer than ``min_run`` (case, dtype) pairs did: a backend that declines
        a case passes it trivially, so a caller that knows how many it must run
        says so. Return self when all pass."""
        too_few = self.num_run < min_run
        if self.ok and not too_few:
            return self
        parts = [f"{self.kind} backend {self.backend!r} failed conformance on {self.device}:"]
        parts += [f"  - {r.describe()}" for r in self.failures]
        parts += [f"  - {p}" for p in self.problems]
        if not self.results and not self.problems:
            parts.append("  - no case ran")
        elif too_few:
            parts.append(f"  - {self.num_run} (case, dtype) pairs ran, {min_run} expected: the rest were declined")
        parts += ["", str(self)]
        raise AssertionError("\n".join(parts))


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[float, float, bool, str | None]:
    """``(max_abs, max_rel, passed, problem)`` for ``out`` against ``ref``, in float64.

    The float64 copies are worked on in place: the outputs of the large cases are
    hundreds of MB in float64, and each fresh temporary is another pass through memory."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("nan"), float("nan"), False, f"shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    o = out.detach().to("cpu", torch.float64, copy=True)  # copies: changed in place below
    r = ref.detach().to("cpu", torch.float64, copy=True)
    if o.numel() == 0:
        return 0.0, 0.0, True, None
    finite = torch.isfinite(out.detach())  # in out's own dtype: the same answer, a quarter of the bytes or less
    if not finite.all():
        bad = int((~finite).sum())
        return float("nan"), float("nan"), False, f"{bad} non-finite values in the output"
    diff = o.sub_(r).abs_()
    r_abs = r.abs_()
    max_abs = float(diff.max())
    max_rel = max_abs / max(float(r_abs.max()), 1e-30)
    passed = bool((diff <= r_abs.mul_(tol.rtol).add_(tol.atol)).all())
    return max_abs, max_rel, passed, None


# ---------------------------------------------------------------------------
# Resolution


def _registry(registry: PluginRegistry | None) -> PluginRegistry:
    if registry is not None:
        return registry
    from radixserve.registry import get_registry

    return get_registry()


def resolve_backend(kind: str, backend: BackendSpec, registry: PluginRegistry | None = None) -> tuple[str, type]:
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


def _torch_device(device: str, registry: PluginRegistry | None) -> torch.device:
    """The torch device of a registered platform; an unknown or unusable one fails loudly."""
    torch_device: torch.device = _registry(registry).resolve_platform(device)().device()
    return torch_device


def _reasons(cls: Any, query: KernelQuery) -> list[str]:  # cls: a backend class
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


@overload
def _f32(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _f32(t: None) -> None: ...
@overload
def _f32(t: torch.Tensor | None) -> torch.Tensor | None: ...
def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
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

    def __init__(
        self,
        kind: str,
        name: str,
        cls: Any,  # the backend class
        ref_name: str,
        ref_cls: Any,  # the reference backend class; None for quantization (a function is its reference)
        device: str,
        dtypes: Iterable[torch.dtype] | None,
        registry: PluginRegistry | None,
    ) -> None:
        self.kind = kind
        self.name, self.cls = name, cls
        self.ref_name, self.ref_cls = ref_name, ref_cls
        self.device = device
        self.explicit_dtypes = dtypes is not None
        self.dtypes = tuple(dtypes) if dtypes is not None else DEFAULT_DTYPES
        self.report = ConformanceReport(kind, name, ref_name, device)
        self.torch_device = _torch_device(device, registry)

    @classmethod
    def resolve(
        cls,
        kind: str,
        backend: BackendSpec,
        device: str,
        dtypes: Iterable[torch.dtype] | None,
        registry: PluginRegistry | None,
        reference: BackendSpec,
    ) -> _Run:
        name, impl = resolve_backend(kind, backend, registry)
        ref_name, ref_cls = resolve_backend(kind, reference, registry)
        return cls(kind, name, impl, ref_name, ref_cls, device, dtypes, registry)

    def claimed_dtypes(self, queries: Callable[[torch.dtype], list[KernelQuery]]) -> list[torch.dtype]:
        """The dtypes the backend claims: those for which it accepts at least one
        of the cases' queries (``queries(dtype)``)."""
        out: list[torch.dtype] = []
        for dtype in self.dtypes:
            first_reasons: list[str] | None = None
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
        ref_query = replace(
            query, device="cpu", dtype=torch.float32, kv_dtype=torch.float32 if query.kv_dtype is not None else None
        )
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
        shared_query: Callable[[torch.dtype], KernelQuery] | None = None,
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
            shared = None if shared_query is None else shared_query(dtype)
            for index, case in enumerate(case_list):
                if shared is None:
                    query = case.query(self.device, dtype)
                    if not self.case_supported(case.name, dtype, query):
                        continue
                else:
                    query = shared
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


def _cases(kind: str, cases: str | Sequence[C], table: Mapping[str, Sequence[C]]) -> Sequence[C]:
    if isinstance(cases, str):
        if cases not in table:
            raise ValueError(f"unknown {kind} case set {cases!r}; choose from {sorted(table)} or pass case objects")
        return table[cases]
    return list(cases)


def batch_on_cpu(b: ForwardBatch, pool: Any) -> ForwardBatch:
    """A copy of ``b`` on the CPU over ``pool`` (the reference's float32 copy of
    the backend's pool): what the kits' reference math reads."""

    def c(x: torch.Tensor) -> torch.Tensor:
        return x.to("cpu", copy=True)

    return ForwardBatch(
        mode=b.mode,
        input_ids=c(b.input_ids),
        positions=c(b.positions),
        out_cache_loc=c(b.out_cache_loc),
        req_pool_indices=c(b.req_pool_indices),
        seq_lens=c(b.seq_lens),
        prefix_lens=c(b.prefix_lens),
        extend_lens=c(b.extend_lens),
        req_to_token=c(b.req_to_token),
        kv_pool=pool,
        seq_lens_cpu=list(b.seq_lens_cpu),
        prefix_lens_cpu=list(b.prefix_lens_cpu),
        extend_lens_cpu=list(b.extend_lens_cpu),
        logits_indices=None if b.logits_indices is None else c(b.logits_indices),
    )
