"""The draft model of speculative decoding (``--speculative-draft-model-path``),
run for a proposer (radixserve.speculative.base.SequenceModel): a ModelRunner of
its own beside the target's (its weights, KV pool and token table, on the same
device and platform, unsharded on every tensor-parallel rank, which all compute
alike), and each request's KV kept between calls.

Per request it keeps a row of its token table and the tokens whose KV it has
computed. A call computes, for each request, the tokens past the longest prefix it
already has (its whole prompt the first time; then the tokens the verify step kept
and the newest one; then one a drafted position), in one forward over the batch;
the KV of tokens that are no longer in a request's sequence (proposals the target
refused) is given back first, page by page, as the target's ledger does. Its pool
is as large as the target's, so the requests the target runs fit; nothing here is
shared with the target's prefix cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from radixserve.cache.token_prefix import common_prefix_len
from radixserve.config import ServerArgs
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.registry import PluginRegistry
from radixserve.runtime.execution.batch import BatchPlan
from radixserve.runtime.execution.model_plan import plan_model
from radixserve.runtime.execution.model_runner import ModelRunner
from radixserve.speculative.base import DraftRequest

logger = logging.getLogger(__name__)


@dataclass
class ComputedTokens:
    row: int  # of the draft's token table
    tokens: list[int]  # whose KV is in the draft's pool, in order
    slots: list[int]  # their slots (on the host: cutting back reads no device)

    @property
    def last_slot(self) -> int:
        return self.slots[-1] if self.slots else -1


class DraftModelRunner:
    flag = "speculative_draft_model_path"  # the flag that names the model, in errors
    what = "draft model"
    state_type: type[ComputedTokens] = ComputedTokens  # what is kept per request

    def __init__(
        self,
        args: ServerArgs,
        registry: PluginRegistry,
        target: ModelRunner,
        path: str,
        config: PretrainedConfig | None = None,
    ):
        """Load the model at ``path`` beside ``target`` (``config``: its config where
        the caller has read and adjusted it)."""
        draft_args = dataclasses.replace(
            args,
            model_path=path,
            tokenizer_path=None,
            quantization=None,
            context_length=None,
            tp_size=1,
            dp_size=1,
            nnodes=1,
            node_rank=0,
            dist_init_addr=None,
            max_total_tokens=target.max_total_tokens,
            max_running_requests=target.max_running_requests,
            disable_graph=True,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            speculative_eagle_path=None,
            disaggregation_mode="null",
            enable_lora=False,  # it proposes base-model tokens; the target verifies them under each adapter
            lora_paths=[],
        )
        plan = None if config is None else plan_model(draft_args, path, registry.resolve_platform(args.device), config)
        self.runner = runner = ModelRunner(draft_args, path, registry, plan=plan)
        if runner.vocab_size != target.vocab_size:
            raise ValueError(
                f"{self.flag}: the draft model's vocabulary has {runner.vocab_size} tokens, "
                f"the target's {target.vocab_size}; a draft must share the target's tokenizer"
            )
        if runner.context_length < target.context_length:
            raise ValueError(
                f"{self.flag}: the draft model's context ({runner.context_length}) is shorter than "
                f"the target's ({target.context_length}); pass --context-length {runner.context_length} or less"
            )
        self.table, self.allocator = runner.req_to_token_pool, runner.allocator
        self._computed: dict[str, ComputedTokens] = {}
        logger.info(
            "draft model %s: %s, backends %s, KV pool %d tokens",
            path,
            runner.hf_config.architectures,
            runner.backends,
            runner.max_total_tokens,
        )

    @property
    def vocab_size(self) -> int:
        vocab: int = self.runner.vocab_size
        return vocab

    def describe(self) -> dict[str, Any]:
        return {
            "model_path": self.runner.args.model_path,
            "backends": dict(self.runner.backends),
            "kv_pool_tokens": self.runner.max_total_tokens,
            "kv_tokens_held": self.tokens_held(),
        }

    def tokens_held(self) -> int:
        """Slots of the draft's pool held by requests (whole pages)."""
        return self.allocator.size - self.allocator.available_size(wait=True)

    def next_token_logits(self, requests: Sequence[DraftRequest]) -> torch.Tensor:
        states = [self._state(r.rid) for r in requests]
        prefix_lens, new = [], []
        for state, request in zip(states, requests, strict=True):
            tokens = request.token_ids
            keep = common_prefix_len(state.tokens, tokens, len(tokens) - 1)  # the last token is always computed
            self._cut(state, keep)
            prefix_lens.append(keep)
            new.append(list(tokens[keep:]))
        batch, _ = self._batch(states, prefix_lens, new)
        return self.runner.forward(batch).float()

    def _batch(
        self, states: Sequence[ComputedTokens], prefix_lens: list[int], new: list[list[int]]
    ) -> tuple[ForwardBatch, list[int]]:
        """The forward batch in which each state's request computes the tokens ``new[i]``
        after its first ``prefix_lens[i]`` (their slots allocated and recorded in the
        state), and where each request's tokens end in it."""
        for state, keep, tokens in zip(states, prefix_lens, new, strict=True):
            self.table.write_tokens(state.row, keep, tokens)
        extend_lens = [len(n) for n in new]
        slots = self.allocator.alloc_slots(prefix_lens, [s.last_slot for s in states], extend_lens)
        if slots is None:
            raise RuntimeError(f"the {self.what}'s KV pool is full (it is as large as the target's)")
        mode = ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND
        ends = list(itertools.accumulate(extend_lens))
        plan = BatchPlan.launch(
            mode,
            [s.row for s in states],
            prefix_lens,
            extend_lens,
            [end - 1 for end in ends],
            None,
            self.table,
            self.runner.transfer,
            slots,
        )
        for state, tokens, end in zip(states, new, ends, strict=True):
            state.tokens += tokens
            state.slots += slots[end - len(tokens) : end]
        return plan.build(self.table, self.runner.kv_pool), ends

    def forget(self, rid: str) -> None:
        state = self._computed.pop(rid, None)
        if state is not None:
            self._cut(state, 0)
            self.table.free(state.row)

    def _state(self, rid: str) -> ComputedTokens:
        state = self._computed.get(rid)
        if state is None:
            row = self.table.alloc()
            if row is None:
                raise RuntimeError(f"the {self.what}'s token table is full (it has a row per running request)")
            state = self._computed[rid] = self.state_type(row, [], [])
        return state

    def _cut(self, state: ComputedTokens, keep: int) -> None:
        """Keep the KV of ``state``'s first ``keep`` tokens; give back the pages past them."""
        if keep >= len(state.tokens):
            return
        page = self.allocator.page_size
        first_free = -(-keep // page) * page
        if first_free < len(state.slots):
            self.allocator.free(torch.tensor(state.slots[first_free:], dtype=torch.int64))
        del state.tokens[keep:], state.slots[keep:]
