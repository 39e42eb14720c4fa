"""Helpers shared by the kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

# ``triton.jit`` itself, typed for mypy (triton ships no type information); a kernel
# stays Triton's JITFunction (InterpretedFunction in the interpreter): ``Any``.
# Triton reads the parameters' annotations: ``tl.constexpr`` marks a compile-time
# constant; the others are ``tl.tensor`` (a pointer or a scalar inside the kernel),
# which Triton treats as unannotated. Never ``int``, ``float`` or ``bool``: Triton
# would take those as fixed argument types (i32, fp32, u1).
jit: Callable[[Callable[..., object]], Any] = triton.jit


@jit
def _probe() -> None:  # pragma: no cover - only its type matters
    pass


# True when the kernels in this process run in Triton's CPU interpreter.
INTERPRETED: bool = type(_probe).__name__ == "InterpretedFunction"


@jit
def mma(a: tl.tensor, b: tl.tensor, UPCAST: tl.constexpr) -> tl.tensor:
    """``a @ b`` with a float32 result.

    ``UPCAST`` computes in float32 (IEEE, no TF32). It is used for float32
    inputs, so fp32 stays fp32-accurate on GPUs, and always in the interpreter,
    whose ``dot`` multiplies the raw bits of bfloat16 operands (it stores them
    as uint16). Otherwise the operands go to the tensor cores in their own
    16-bit dtype, accumulating in float32.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


@jit
def cast_to(x: tl.tensor, DTYPE: tl.constexpr, RNE_BF16: tl.constexpr) -> tl.tensor:
    """``x.to(DTYPE)``. ``RNE_BF16`` rounds float32 to bfloat16 to nearest-even by
    hand: the interpreter's own float32->bfloat16 cast truncates, while GPUs (and
    torch) round to nearest even. Finite inputs only."""
    if RNE_BF16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


def rne_bf16(dtype: torch.dtype) -> bool:
    """Whether stores of ``dtype`` need ``cast_to``'s hand rounding (interpreter only)."""
    import torch

    return INTERPRETED and dtype == torch.bfloat16


def upcast_dots(dtype: torch.dtype) -> bool:
    import torch

    return INTERPRETED or dtype == torch.float32


def next_pow2(n: int, minimum: int = 16) -> int:
    power: int = triton.next_power_of_2(int(n))
    return max(minimum, power)
