"""The batch a model forward sees: flat new tokens plus the paged KV layout.

It sits in the contract layer because attention backends read it. The runtime
builds one per step from a ScheduleBatch (see runtime/execution/batch.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixserve.cache.memory_pool import KVPool

if TYPE_CHECKING:  # kernels/ imports this module
    from radixserve.kernels.lora import LoRABatch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new prompt tokens per request, possibly after a cached prefix
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    """One model step over ``batch_size`` requests and ``num_tokens`` new tokens.

    Request ``i`` owns ``req_to_token[req_pool_indices[i], :seq_lens[i]]``, the KV
    slots of all its tokens. Its first ``prefix_lens[i]`` tokens are already in the
    KV pool; the next ``extend_lens[i]`` are new in this step, laid out contiguously
    in ``input_ids``/``positions``/``out_cache_loc`` in request order.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slot for each new token
    req_pool_indices: torch.Tensor  # [batch_size] int64
    seq_lens: torch.Tensor  # [batch_size] int64: total tokens after this step
    prefix_lens: torch.Tensor  # [batch_size] int64: tokens already in the KV pool
    extend_lens: torch.Tensor  # [batch_size] int64: new tokens this step
    req_to_token: torch.Tensor  # [max_requests, max_context] int64 slot table
    kv_pool: KVPool
    # Host copies, so backends and the runner need no device sync to loop.
    seq_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    # Flat indices (into the new tokens) whose hidden states become logits.
    logits_indices: torch.Tensor | None = None
    # Scratch space an attention backend fills in ``init_forward_metadata``.
    attn_metadata: Any = None
    # [num_tokens] int64: each new token's row of the rotary table where that is not
    # its position (a LongRoPE request on the long set reads the table's second half,
    # layers/rotary.py); None: every token's row is its position.
    rope_table_rows: torch.Tensor | None = None
    # Multi-LoRA serving: which adapter slot each new token uses (None: LoRA is off).
    lora: LoRABatch | None = None
    # Speculative decoding with an EAGLE head (runtime/execution/eagle_head.py): with
    # ``capture_hidden`` set, a model that serves as a target keeps the features of every
    # new token in ``hidden_states`` (the final hidden state, the LM head's input; for an
    # EAGLE-3 head, the outputs of the layers it reads side by side); the head reads its
    # input features, one per new token, from ``input_features``.
    capture_hidden: bool = False
    hidden_states: torch.Tensor | None = None
    input_features: torch.Tensor | None = None

    @property
    def rope_rows(self) -> torch.Tensor:
        """Each new token's row of the rotary table."""
        return self.positions if self.rope_table_rows is None else self.rope_table_rows

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def extend_start_loc(self) -> list[int]:
        """Offset of each request's first new token in the flat token arrays."""
        starts, acc = [], 0
        for n in self.extend_lens_cpu:
            starts.append(acc)
            acc += n
        return starts
