"""The EAGLE head of speculative decoding (``--speculative-eagle-path``), run for a
proposer as a ``SequenceModel`` (radixserve.speculative.base): the head's own
ModelRunner (models/eagle.py; its KV pool and token table, as the draft model
keeps them in draft_model.py), fed the target's features.

The head's position ``p`` joins the target's feature of position ``p`` (what the
target computed for token ``p``: its final hidden state for an EAGLE-1/2 head, three
layers' outputs side by side for an EAGLE-3 head, which the target keeps once told
which) with token ``p + 1``; its output there stands for the target's feature of
``p + 1``. So for a request whose newest token is ``t_m`` it computes positions up
to ``m - 1`` and proposes from the last. The target's features arrive after each
target step (``take_features``: the positions that step computed and kept) and wait
per request until the head computes their positions, when the head reads them
(``read_target_features``: EAGLE-3's ``fc``, for the whole batch at once); where the
head runs ahead of the target (the second proposal of a step and later), a position
reads the head's own output of the position before, and is computed again with the
target's feature once that arrives.

A request whose prompt was found in the radix cache gives the head no features
for its cached part: the head's sequence starts at the first position the
target computed for it (its positions count from there; rotary attention sees
the same distances). Features wait at most ``FEATURE_BACKLOG`` a request: past
that, a request in a batch small enough to speculate (or a prompt about to) has
them computed at once (``catch_up``); one in a batch too large to
(``--speculative-max-batch-size``) keeps the newest half, and its head sequence
starts again from them (``trim``), so a large batch pays no head compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from radixserve.cache.token_prefix import common_prefix_len
from radixserve.checkpoints.loader import load_config
from radixserve.config import ServerArgs
from radixserve.models.eagle import LlamaEagle3Head, LlamaEagleHead
from radixserve.registry import PluginRegistry
from radixserve.runtime.execution.draft_model import ComputedTokens, DraftModelRunner
from radixserve.runtime.execution.model_runner import ModelRunner
from radixserve.speculative.base import DraftRequest

FEATURE_BACKLOG = 256  # target features a request may hold waiting (then: catch_up or trim)


@dataclass
class _HeadState(ComputedTokens):
    """``tokens[j]`` is token ``base + j + 1``, read at the head's position ``base + j``
    with the target's feature there (the first ``target_run`` positions) or the head's
    own output of the position before (the rest)."""

    base: int = -1  # the first position the head computes for this request (-1: none yet)
    target_run: int = 0
    # The target's features not yet read, positions ``feature_start`` on, in the pieces
    # they came in (joined when read: a request that decodes unasked adds one a step).
    feature_start: int = 0
    feature_parts: list[torch.Tensor] = field(default_factory=list)
    feature_count: int = 0
    last_output: tuple[int, torch.Tensor] | None = None  # (position, the head's output there)

    @property
    def feature_end(self) -> int:
        return self.feature_start + self.feature_count

    def features(self) -> torch.Tensor:
        """The waiting features, ``[feature_count, hidden]``."""
        if len(self.feature_parts) > 1:
            self.feature_parts = [torch.cat(self.feature_parts)]
        return self.feature_parts[0]

    def set_features(self, start: int, features: torch.Tensor | None) -> None:
        self.feature_start = start
        self.feature_parts = [features] if features is not None and len(features) else []
        self.feature_count = len(self.feature_parts[0]) if self.feature_parts else 0


class EagleHeadRunner(DraftModelRunner):
    flag = "speculative_eagle_path"
    what = "EAGLE head"
    state_type = _HeadState

    def __init__(self, args: ServerArgs, registry: PluginRegistry, target: ModelRunner):
        path = args.speculative_eagle_path
        if path is None:
            raise ValueError("speculative_eagle_path: --speculative-algorithm eagle reads an EAGLE head; name one")
        embed_and_head = getattr(target.model, "embed_and_head", None)
        if embed_and_head is None:
            raise ValueError(
                f"speculative_algorithm: an EAGLE head reads the target's hidden states, which "
                f"{type(target.model).__name__} does not expose (Llama-family models do)"
            )
        config = load_config(path)
        if getattr(config, "model_type", None) != "llama":
            raise ValueError(
                f"speculative_eagle_path: {path} is not an EAGLE head in EAGLE-1/2's or EAGLE-3's layout "
                f"(its config.json says model_type {getattr(config, 'model_type', None)!r}, not 'llama')"
            )
        if config.hidden_size != target.hf_config.hidden_size:
            raise ValueError(
                f"speculative_eagle_path: the head's hidden size is {config.hidden_size}, the target's "
                f"{target.hf_config.hidden_size}; the head was trained for another model"
            )
        eagle3 = LlamaEagle3Head.architectures[0] in (getattr(config, "architectures", None) or [])
        head_class: type[LlamaEagleHead | LlamaEagle3Head] = LlamaEagle3Head if eagle3 else LlamaEagleHead
        config.architectures = list(head_class.architectures)
        layer_ids = head_class.target_layers(config, target.hf_config.num_hidden_layers)
        if layer_ids:
            keep_layer_outputs = getattr(target.model, "keep_layer_outputs", None)
            if keep_layer_outputs is None:
                raise ValueError(
                    f"speculative_eagle_path: an EAGLE-3 head reads the outputs of the target's layers, "
                    f"which {type(target.model).__name__} does not expose"
                )
            keep_layer_outputs(layer_ids)
        self.feature_size = config.hidden_size * max(1, len(layer_ids))  # the width of a target feature
        super().__init__(args, registry, target, path, config)
        self.head = cast(LlamaEagleHead | LlamaEagle3Head, self.runner.model)
        self.head.attach(*embed_and_head())

    def take_features(self, rid: str, start: int, features: torch.Tensor) -> bool:
        """The target computed (and kept) the tokens of request ``rid`` at positions
        ``[start, start + len(features))``, with these final hidden states. Returns
        whether more than ``FEATURE_BACKLOG`` wait (``catch_up`` is then due)."""
        state = self._state(rid)
        if state.feature_count and state.feature_start <= start <= state.feature_end:
            if start < state.feature_end:  # positions computed again (a retracted request's)
                state.set_features(state.feature_start, state.features()[: start - state.feature_start])
            state.feature_parts.append(features)
            state.feature_count += len(features)
        else:
            state.set_features(start, features)
        if state.base >= 0 and state.feature_start > state.base + state.target_run:
            self._restart(state)  # a gap between what the head computed and the features: start again there
        return state.feature_count > FEATURE_BACKLOG

    def trim(self, rid: str) -> None:
        """Keep only the newest half of request ``rid``'s ``FEATURE_BACKLOG`` features
        and start its head sequence again from them (for a request that decodes unasked:
        its head then drafts from that much context and more when asked again)."""
        state = self._state(rid)
        self._restart(state)
        keep = FEATURE_BACKLOG // 2
        state.set_features(state.feature_end - keep, state.features()[-keep:])

    def catch_up(self, rid: str, token_ids: Sequence[int]) -> None:
        """Compute every position of request ``rid`` whose target feature is here
        (``token_ids``: its tokens, at least one past those positions)."""
        state = self._state(rid)
        self.next_token_logits([DraftRequest(rid, token_ids[: state.feature_end + 1], 0)])

    def next_token_logits(self, requests: Sequence[DraftRequest]) -> torch.Tensor:
        states = [self._state(r.rid) for r in requests]
        prefix_lens, new, target_rows, own_rows, starts = [], [], [], [], []
        for state, request in zip(states, requests, strict=True):
            keep, tokens, rows, own = self._plan(state, request)
            self._cut(state, keep)
            prefix_lens.append(keep)
            new.append(tokens)
            target_rows.append(rows)
            own_rows.append(own)
            starts.append(state.base + keep)  # the first position computed
        batch, ends = self._batch(states, prefix_lens, new)
        batch.input_features = self._input_features(target_rows, own_rows)
        batch.capture_hidden = True
        logits = self.runner.forward(batch).float()
        outputs = batch.hidden_states
        assert outputs is not None  # the head keeps them when asked
        for state, first, end, computed in zip(states, starts, ends, new, strict=True):
            if state.target_run == first - state.base:  # the target's features continue the run
                state.target_run += min(len(computed), max(0, state.feature_end - first))
            state.last_output = (state.base + len(state.tokens) - 1, outputs[end - 1].clone())
            self._drop_read_features(state)
        return logits

    def _input_features(self, target_rows: list[torch.Tensor], own_rows: list[torch.Tensor | None]) -> torch.Tensor:
        """Each request's positions' features as the head reads them: the target's (read
        in one call for the batch), then the head's own output where it runs ahead."""
        runner = self.runner
        joined = torch.cat(target_rows).to(device=runner.device, dtype=runner.dtype)
        read = torch.split(self.head.read_target_features(joined), [len(rows) for rows in target_rows])
        pieces = [
            rows if own is None else torch.cat([rows, own.unsqueeze(0).to(rows)])
            for rows, own in zip(read, own_rows, strict=True)
        ]
        return torch.cat(pieces)

    def _plan(
        self, state: _HeadState, request: DraftRequest
    ) -> tuple[int, list[int], torch.Tensor, torch.Tensor | None]:
        """What to compute for ``request``: the head positions to keep, the tokens of
        the positions after them, the target's features of those positions, and the
        head's own output standing for the last one's where the head runs ahead."""
        token_ids = request.token_ids
        if state.base < 0:
            if not state.feature_count:
                raise RuntimeError(f"the EAGLE head has no target features for request {request.rid}")
            state.base = state.feature_start
        base, last = state.base, len(token_ids) - 2  # the last position the head computes
        if last < base:
            raise RuntimeError(f"the EAGLE head has nothing to compute for request {request.rid}")
        # Positions still right: the same tokens (the last position is always computed: its
        # output is asked), up to the first one computed from the head's own output where
        # the target's feature has arrived since.
        keep = common_prefix_len(state.tokens, token_ids[base + 1 :], min(len(state.tokens), last - base))
        redo = max(state.target_run, state.feature_start - base)
        if redo < state.feature_end - base:
            keep = min(keep, redo)
        first = base + keep
        tokens = list(token_ids[first + 1 : last + 2])
        target_rows = max(0, min(state.feature_end, last + 1) - first)
        if target_rows and first < state.feature_start:  # the features of positions it must redo are gone
            self._restart(state)
            return self._plan(state, request)
        rows = self._features(state, first, target_rows)
        if target_rows == len(tokens):
            return keep, tokens, rows, None
        output = state.last_output  # the head runs ahead: its own output stands for the target's feature
        if len(tokens) - target_rows != 1 or output is None or output[0] != first + target_rows - 1:
            raise RuntimeError(
                f"the EAGLE head has no feature for position {first + target_rows} of request {request.rid}"
            )
        return keep, tokens, rows, output[1]

    def _features(self, state: _HeadState, first: int, count: int) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, self.feature_size, dtype=self.runner.dtype, device=self.runner.device)
        assert state.feature_start <= first and first + count <= state.feature_end
        offset = first - state.feature_start
        return state.features()[offset : offset + count]

    def _drop_read_features(self, state: _HeadState) -> None:
        """Features at positions the head computed from them are not needed again, but
        for the last (a call that changes nothing computes its last position again)."""
        done = state.base + state.target_run - 1
        if done > state.feature_start:
            rest = state.features()[done - state.feature_start :] if done < state.feature_end else None
            state.set_features(done, rest)

    def _restart(self, state: _HeadState) -> None:
        self._cut(state, 0)
        state.base, state.last_output = -1, None

    def _cut(self, state: ComputedTokens, keep: int) -> None:
        super()._cut(state, keep)
        if isinstance(state, _HeadState):  # every state of this runner
            state.target_run = min(state.target_run, keep)

    def _state(self, rid: str) -> _HeadState:
        return cast(_HeadState, super()._state(rid))
