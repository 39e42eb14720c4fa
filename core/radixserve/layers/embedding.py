"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of ``tp_size`` and each rank holds a
contiguous block of rows; padding rows are zero and their logits are cut off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.layers.parallel import all_gather_last_dim, all_reduce
from radixserve.layers.weights import copy_into, set_weight_loader


class VocabParallelEmbedding(Layer):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: ModelContext):
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // ctx.tp_size)
        self.vocab_start = ctx.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.create_weights(hidden_size)

    def create_weights(self, hidden_size: int) -> None:
        """This rank's rows of the table, each parameter filled by ``weight_loader``."""
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size, dtype=self.ctx.dtype), requires_grad=False
        )
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"embedding has {loaded.shape[0]} rows in the checkpoint, expected vocab_size {self.vocab_size}"
            )
        rows = self.vocab_end - self.vocab_start
        param.data[rows:].zero_()
        copy_into(param.data[:rows], loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return all_reduce(out, self.ctx)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, rows_per_rank={self.rows_per_rank}"


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary, via ``ctx.gemm.linear``.

    For tied embeddings the model points ``weight`` at the embedding's parameter
    (same shape and sharding), and the checkpoint then needs no ``lm_head.weight``.
    Where the GEMM backend prepares weights (the CPU backends pack them), a tied
    head keeps a prepared copy of its own (``prepared_weight``, a buffer): one
    table more in memory, where the backend would otherwise prepare the dense
    table again at every step (a quarter of a small model's step on the CPU).

    A checkpoint that stores the head quantized (``QuantizedCheckpoint.lm_head``: GGUF
    files) has it loaded, stored and applied by the quantization method (``quant``), as
    a column-parallel linear layer of the vocabulary's rows.
    """

    tied = False
    prepared_weight: torch.Tensor | None

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ModelContext):
        super().__init__(vocab_size, hidden_size, ctx)
        self.register_buffer("prepared_weight", None, persistent=False)

    def create_weights(self, hidden_size: int) -> None:
        """A dense table, or the quantization method's tensors where the checkpoint stores
        the head quantized (each row-sharded by ``weight_loader`` as the table would be)."""
        scheme = self.ctx.quant.query.quantized_checkpoint
        self.quant = self.ctx.quant if scheme is not None and scheme.lm_head else None
        if self.quant is None:
            super().create_weights(hidden_size)
        else:
            self.quant.create_weights(self, hidden_size, self.rows_per_rank, self.ctx.dtype, self.weight_loader)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            logits = self.quant.apply(self, hidden, None)
        else:
            weight = self.prepared_weight if self.prepared_weight is not None else self.weight
            logits = self.ctx.gemm.linear(hidden, weight)
        logits = all_gather_last_dim(logits, self.ctx)
        return logits[..., : self.vocab_size]

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        if self.quant is not None:
            raise ValueError("quantization_config.lm_head_type: a quantized LM head cannot be tied to the embeddings")
        self.weight = embedding.weight
        self.tied = True

    def process_weights_after_loading(self) -> None:
        """The weight goes through the GEMM backend's ``prepare_weight`` once, as a
        linear layer's does: an untied head's is replaced by what it returns, a tied
        one's stays the embedding's dense table beside its prepared copy. A quantized
        head is the quantization method's to convert."""
        if self.quant is not None:
            self.quant.process_weights_after_loading(self)
            return
        prepared = self.ctx.gemm.prepare_weight(self.weight.data)
        if prepared is self.weight.data:
            return
        if self.tied:
            self.prepared_weight = prepared
        else:
            self.weight = nn.Parameter(prepared, requires_grad=False)
