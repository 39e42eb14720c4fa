"""Fused elementwise ops of a decoder layer: RMSNorm (with the residual add fused
in), rotary embedding applied in place, and SiLU-and-mul; the ops only some
models call (:data:`MODEL_SPECIFIC_OPS`): Gemma's RMSNorm and GELU(tanh)-and-mul;
and the sampler's one: a grammar's token bitmask applied to the logits.

One backend object serves every layer of a model. The semantics are
HuggingFace's, so that a model built from these ops generates what transformers
does:

- ``rms_norm``: with ``residual``, first ``residual = x + residual`` in the model
  dtype; then normalise in float32 (``x * rsqrt(mean(x^2) + eps)``), cast back
  to the model dtype, and multiply by ``weight``.
- ``apply_rotary``: ``cos_sin_cache[p]`` holds ``cos(p * f_i)`` for the
  ``rotary_dim / 2`` frequencies ``f_i``, then ``sin(p * f_i)`` (already scaled
  and rounded to the model dtype; :func:`rope_cos_sin_cache` builds it). Pair
  ``i`` of a head, ``(x1, x2)``, becomes ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``. NeoX style pairs ``x[i]`` with
  ``x[i + rotary_dim / 2]`` (HF Llama's "rotate half"); otherwise (GPT-J style)
  ``x[2i]`` with ``x[2i + 1]``. Only the first ``rotary_dim`` dims of each head
  turn (partial rotary); the rest are left alone.
- ``silu_and_mul``: ``silu(x[..., :I]) * x[..., I:]``, as ``act(gate) * up``.
- ``gemma_rms_norm``: as ``rms_norm`` (the residual add first, in the model
  dtype), but the float32 normalised value is multiplied by ``1 + weight`` in
  float32 and only the product is cast to the model dtype (HF's
  ``Gemma2RMSNorm``/``Gemma3RMSNorm``: the checkpoint stores the offset from 1).
- ``gelu_tanh_and_mul``: ``gelu_tanh(x[..., :I]) * x[..., I:]``, the tanh
  approximation of GELU (``F.gelu(approximate="tanh")``, HF's
  ``gelu_pytorch_tanh``), rounded to the model dtype before the product.

A model names the model-specific ops it calls in ``ModelFacts.elementwise_ops``,
which reach selection as ``KernelQuery.elementwise_ops``; a backend that lacks
one refuses such a query by name (:func:`elementwise_op_reasons`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixserve.kernels.base import Backend
from radixserve.kernels.query import KernelQuery

NormResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

#: The ops beyond ``rms_norm``, ``apply_rotary`` and ``silu_and_mul``: only the
#: models that call them need them (``KernelQuery.elementwise_ops``).
MODEL_SPECIFIC_OPS = ("gemma_rms_norm", "gelu_tanh_and_mul")


class ElementwiseBackend(Backend):
    """The ``elementwise`` kernel kind (``--elementwise-backend``).

    Selection looks at ``query.device`` and ``query.dtype`` (and may look at
    ``query.head_dim`` for rotary). Implementations must not synchronise with
    the host (they run inside captured graphs).
    """

    def __init__(self, query: KernelQuery):
        self.query = query

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> NormResult:
        """RMSNorm over the last dimension of ``x`` ``[..., H]`` (``weight`` ``[H]``).

        Without ``residual``: returns a new tensor and leaves ``x`` alone (it may
        be a strided view, e.g. the q heads of a fused QKV output). With
        ``residual`` (same shape as ``x``): returns ``(normed, x + residual)``;
        the backend may reuse the storage of ``x`` and ``residual`` for them, so
        the caller must use only the returned tensors afterwards.
        """
        raise NotImplementedError

    def apply_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        neox_style: bool = True,
    ) -> None:
        """Rotate ``q`` ``[T, heads, D]`` and ``k`` ``[T, kv_heads, D]`` in place.

        ``positions`` ``[T]`` (int64) index ``cos_sin_cache``
        ``[max_positions, rotary_dim]`` (``rotary_dim <= D``, even). ``q`` and
        ``k`` may be strided views (of a fused QKV output); the last dimension
        is contiguous.
        """
        raise NotImplementedError

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., 2 * I] -> [..., I]``: ``silu(gate) * up`` with gate the first half."""
        raise NotImplementedError

    # -- model-specific ops: a backend that has them says so in unsupported_reasons

    def gemma_rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> NormResult:
        """``rms_norm`` with Gemma's weight: ``(x * rsqrt(mean(x^2) + eps)) * (1 + weight)``
        all in float32, then cast to the model dtype. Same shapes, views and
        residual contract as :meth:`rms_norm`."""
        raise NotImplementedError

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., 2 * I] -> [..., I]``: ``gelu_tanh(gate) * up`` with gate the first half."""
        raise NotImplementedError

    # -- the sampler's op

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Mask ``logits`` ``[B, V]`` in place with ``bitmask`` ``[R, ceil(V / 32)]``
        (int32) for its rows ``rows`` ``[R]`` (int64, distinct), all on the
        logits' device (the module docstring gives the semantics)."""
        apply_token_bitmask(logits, bitmask, rows)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The torch code of :meth:`ElementwiseBackend.apply_token_bitmask`: one vectorised
    pass on any device, through an unpacked ``[R, V]`` mask."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def rope_cos_sin_cache(
    inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[max_positions, 2 * len(inv_freq)]``: per position, the cosines then the
    sines of ``position * inv_freq``, scaled, in ``dtype``: the layout
    :meth:`ElementwiseBackend.apply_rotary` reads. Every value is computed as HF
    computes it per step (float32 angles, cos/sin, scale, cast), so the table
    holds exactly HF's numbers. The model's rotary layer
    (radixserve/layers/rotary.py) builds its table with it, from the rope
    frequencies of its config; the elementwise cases (``kernels/cases``) too."""
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.int64)
    freqs = positions[:, None].float() * inv_freq[None, :]
    return torch.cat(((freqs.cos() * attention_scaling).to(dtype), (freqs.sin() * attention_scaling).to(dtype)), dim=-1)


def elementwise_op_reasons(query: KernelQuery, name: str, supported: Iterable[str] = ()) -> list[str]:
    """Why backend ``name``, which implements the model-specific ops in
    ``supported`` (of :data:`MODEL_SPECIFIC_OPS`), cannot serve the ops that
    ``query``'s model calls."""
    have = set(supported)
    return [f"{name} has no {op} (the model calls it)" for op in query.elementwise_ops or () if op not in have]
