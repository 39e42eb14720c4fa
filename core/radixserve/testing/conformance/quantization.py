"""The quantization kit: the reference semantics of the documented methods
(``QUANT_REFERENCES``), ``QuantCase`` and its case sets, and
``check_quantization_method``, which drives a method's whole lifecycle."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import KernelQuery, QuantizedCheckpoint
from radixserve.testing.conformance.base import (
    BackendSpec,
    CaseResult,
    ConformanceReport,
    Tolerance,
    Tolerances,
    _cases,
    _f32,
    _reasons,
    _Run,
    _score,
    resolve_backend,
)
from radixserve.testing.quantized_checkpoints import pack_weight, rounded_activations

if TYPE_CHECKING:
    from radixserve.registry import PluginRegistry


def _dense_semantics(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _int8_semantics(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Symmetric per-output-channel int8 weights (scale = max|w| / 127), round half to even."""
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(weight / scale[:, None]), -127, 127)
    return F.linear(x, q * scale[:, None], bias)


def _fp8_semantics(per_channel_weight: bool) -> QuantReference:
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

    def semantics(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w_max = weight.abs().amax(dim=1, keepdim=True) if per_channel_weight else weight.abs().amax()
        w_scale = w_max.clamp(min=1e-12) / 448.0
        x_scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
        return F.linear(e4m3(x, x_scale) * x_scale, e4m3(weight, w_scale) * w_scale, bias)

    return semantics


QuantReference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

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
QUANT_CASES: dict[str, tuple[QuantCase, ...]] = {
    "quick": _QUANT_QUICK,
    "standard": _QUANT_STANDARD,
    "full": _QUANT_STANDARD,
}


def _quant_inputs(
    case: QuantCase, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
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
    dtypes: Iterable[torch.dtype] | None = None,
    registry: PluginRegistry | None = None,
    *,
    gemm: BackendSpec = "torch",
    reference: QuantReference | None = None,
    cases: str | Sequence[QuantCase] = "standard",
    tolerances: Tolerances = None,
    seed: int = 0,
    checkpoint: QuantizedCheckpoint | None = None,
) -> ConformanceReport:
    """Drive the lifecycle (``create_weights`` -> load through each parameter's
    ``weight_loader`` -> ``process_weights_after_loading`` -> ``apply``) and compare
    with the method's reference semantics (``QUANT_REFERENCES`` by name, or
    ``reference``) computed in float32 from the float checkpoint weight.

    The kit loads one float checkpoint tensor named ``weight`` (quantizing at load
    time, as ``none`` and ``int8`` do); a method whose parameters need other
    checkpoint tensors fails with a message saying so. With ``checkpoint`` (a GPTQ or
    AWQ scheme: a method that loads checkpoints that ship quantized), the kit
    quantizes each case's weight by it, packs it as that format's tensors
    (``radixserve.testing.quantized_checkpoints.pack_weight``; act-order in a random
    order of the inputs), loads them by name, and the reference is the product with
    the weight they stand for, dequantized."""
    name, cls = resolve_backend("quantization", method, registry)
    _, gemm_cls = resolve_backend("gemm", gemm, registry)
    semantics = reference or (_dense_semantics if checkpoint else QUANT_REFERENCES.get(name))
    ref_label = (
        "the given reference"
        if reference
        else "the dequantized checkpoint"
        if checkpoint
        else (f"{name} semantics" if semantics else "no reference")
    )
    run = _Run("quantization", name, cls, ref_label, None, device, dtypes, registry)
    report = run.report
    if semantics is None:
        report.problems.append(
            f"no reference semantics known for quantization method {name!r}: pass reference=f(weight, x, bias)"
        )
        return report
    case_list = _cases("quantization", cases, QUANT_CASES)

    def check_one(
        case: QuantCase,
        dtype: torch.dtype,
        query: KernelQuery,
        tol: Tolerance,
        result: CaseResult,
        case_seed: int,
    ) -> None:
        weight, x, bias = _quant_inputs(case, dtype, case_seed)
        tensors = {"weight": weight}
        x_seen = _f32(x)  # the input as the layer's arithmetic sees it
        if checkpoint is not None:  # the weight as a quantized checkpoint ships it, and what it stands for
            order = torch.randperm(case.in_features, generator=torch.Generator().manual_seed(case_seed))
            tensors, weight = pack_weight(weight, checkpoint, order if checkpoint.desc_act else None)
            if checkpoint.activations:  # W8A8: the inputs rounded too (a static scale calibrated on them)
                x_seen, input_scale = rounded_activations(checkpoint, x_seen)
                if input_scale is not None:
                    tensors["input_scale"] = input_scale
        expected = semantics(_f32(weight), x_seen, _f32(bias))

        gemm_reasons = _reasons(gemm_cls, query)
        if gemm_reasons:
            raise RuntimeError(f"gemm backend {gemm!r} cannot serve {query.describe()}: {'; '.join(gemm_reasons)}")
        impl = cls(query, gemm_cls(query))
        layer = nn.Module()

        def loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: object = None) -> None:
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
            if pname not in tensors:
                raise AssertionError(
                    f"parameter {pname!r} needs a checkpoint tensor the kit does not know how to make; "
                    f"the kit loads {', '.join(tensors)}"
                )
            param_loader(param, tensors[pname].to(run.torch_device))
        impl.process_weights_after_loading(layer)
        out = impl.apply(layer, x.to(run.torch_device), None if bias is None else bias.to(run.torch_device))
        result.passed = _score(result, out, expected, dtype, tol)

    return run.check_each(
        case_list,
        tolerances,
        seed,
        check_one,
        shared_query=lambda dt: KernelQuery(
            device=device, dtype=dt, quantization=name, quantized_checkpoint=checkpoint
        ),
    )
