"""The scheduler: waiting queue -> prefill plan or decode batch -> model ->
sampler -> results. Usable in-process, one ``step()`` at a time, and inside the
scheduler process loop (``runtime/processes/scheduler_process.py``).

It keeps the request lifecycle and composes the parts that do the rest: the KV
ledger (``kv_ledger.py``), the prefill planner (``prefill_planner.py``), the
model worker, overlapping a step with the host work of the next
(``model_worker.py``), the batch plan (``batch.py``), the grammar queue
(structured output: ``grammar_queue.py``), embedding pooling (``pooling.py``),
and what is sent and logged (``outbox.py``, ``stats.py``).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, cast

import torch

from radixserve.cache.chunk_cache import ChunkCache
from radixserve.cache.radix_cache import RadixCache
from radixserve.checkpoints.loader import eos_token_ids
from radixserve.checkpoints.lora import AdapterError
from radixserve.config import ServerArgs
from radixserve.forward_batch import ForwardMode
from radixserve.kernels import LoRABatch
from radixserve.messages import FinishReason, GenerateRequest, RoomRegistration, TokenOutput
from radixserve.models.base import check_served_alone
from radixserve.registry import PluginRegistry, get_registry
from radixserve.runtime.execution.batch import BatchPlan, LogitsRows
from radixserve.runtime.execution.distributed import RankSpec
from radixserve.runtime.execution.lora_adapters import LoRAAdapters
from radixserve.runtime.execution.model_plan import ModelPlan
from radixserve.runtime.execution.model_runner import ModelRunner
from radixserve.runtime.execution.model_worker import LaunchedStep, ModelWorker, StepResult, StepWork
from radixserve.runtime.execution.profiler import StepProfiler
from radixserve.runtime.execution.request import HoldsKV, Req, is_lora_namespace
from radixserve.runtime.execution.sampler import Sampler
from radixserve.runtime.execution.verifier import walk
from radixserve.runtime.scheduling.disaggregation import DecodeArrivals, FirstToken, PrefillHandoff, kv_side
from radixserve.runtime.scheduling.intake import Intake
from radixserve.runtime.scheduling.kv_ledger import KVLedger
from radixserve.runtime.scheduling.outbox import Outbox, add_input_logprobs
from radixserve.runtime.scheduling.prefill_planner import PrefillPlan, PrefillPlanner, QueueView, adapter_fits
from radixserve.runtime.scheduling.rope_sets import RopeSets
from radixserve.runtime.scheduling.speculation import Speculation
from radixserve.runtime.scheduling.stats import OperatorLog, SchedulerStats, ServingTotals, StepRates, tokens_to_prefill
from radixserve.runtime.scheduling.stop import StopChecker, internal_error, out_of_memory
from radixserve.structured_output.grammar_queue import GrammarQueue

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        model_path: str,
        tokenizer: Any,
        registry: PluginRegistry | None = None,
        rank: RankSpec | None = None,
        plan: ModelPlan | None = None,
    ):
        """``rank``: this process's tensor-parallel rank (tp_size > 1); every rank
        runs a Scheduler on the same messages, so they schedule alike. ``plan``:
        the model plan made before the ranks started (``model_plan.py``)."""
        self.args = args
        self.runner = runner = ModelRunner(args, model_path, registry or get_registry(), rank, plan)
        check_served_alone(type(runner.model), model_path)  # an Engine's model; the CLI checked before loading
        cache = (ChunkCache if args.disable_radix_cache else RadixCache)(runner.allocator, args.page_size)
        self.ledger = KVLedger(runner.allocator, runner.req_to_token_pool, cache)
        self.max_running = runner.max_running_requests
        self.planner = PrefillPlanner(args, self.ledger, self.max_running)
        self.intake = Intake(args, runner.vocab_size, runner.context_length, self.ledger.total, runner.embedding)
        eos_ids = eos_token_ids(model_path, runner.hf_config, tokenizer)
        masking = runner.elementwise.apply_token_bitmask  # a grammar's token mask, by the plugin's kernel
        self.sampler = Sampler(runner.vocab_size, runner.device, args.random_seed, eos_ids, runner.transfer, masking)
        self.stop_checker = StopChecker(tokenizer, eos_ids)
        self.grammars = GrammarQueue.for_model(args, model_path, runner, eos_ids)
        registry = registry or get_registry()
        self.speculation = Speculation.create(args, registry, runner)
        no_overlap = args.disable_overlap_schedule
        overlap = runner.platform.overlap_schedule if no_overlap is None else not no_overlap
        if self.speculation is not None and overlap:
            logger.info("overlap scheduling: off (speculative decoding proposes from the last step's tokens)")
            overlap = False
        keep_hidden = self.speculation is not None and self.speculation.reads_hidden_states
        self.worker = ModelWorker(
            runner, self.sampler, runner.req_to_token_pool, runner.transfer, overlap, keep_hidden_states=keep_hidden
        )
        self.profiler = StepProfiler(runner.platform.profiler_activities(), rank=runner.group.rank)
        self.rope_sets = RopeSets(runner.long_rope)
        self.totals, self.rates, self.oplog = ServingTotals(), StepRates(), OperatorLog(args.decode_log_interval)

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None  # admitted, its prompt not all prefilled yet
        self.new_token_ratio = args.init_new_token_ratio
        self._by_rid: dict[str, Req] = {}
        self.outbox = Outbox(args.stream_interval)
        self._launching: list[Req] | None = None  # the requests of the step being launched
        self._in_flight: LaunchedStep | None = None  # launched, not awaited yet (overlap)
        self._unprocessed: LaunchedStep | None = None  # awaited, tokens not digested yet
        # Prefill/decode disaggregation (disaggregation.py): the part of this worker's mode.
        mode, group = args.disaggregation_mode, runner.group
        side = kv_side(runner.kv_pool, runner.platform.name, group) if mode != "null" else None
        self.handoff = (
            PrefillHandoff(args, runner.kv_pool, side, registry, group) if side and mode == "prefill" else None
        )
        self.arrivals = (
            DecodeArrivals(args, runner.kv_pool, side, registry, group) if side and mode == "decode" else None
        )

    # ---- intake ------------------------------------------------------------
    def add_request(self, msg: GenerateRequest | Req) -> None:
        """Queue a request, or finish it at once: a 400 if it can never be served or
        names something wrong (``Intake``), a 503 if the queue is full."""
        req, refusal = self.intake.receive(msg)
        self._by_rid[req.rid] = req
        self.rope_sets.choose(req)
        if refusal is None and req.lora_name is not None:
            refusal = self._take_adapter(req)
        if refusal is None and req.bootstrap is not None:
            self._cut_to_first_token(req)
        if refusal is None and self._queue_full():
            message = f"too many queued requests; --max-queued-requests is {self.args.max_queued_requests}"
            refusal = FinishReason(type="abort", status_code=503, message=message)
        if refusal is not None:
            self._finish(req, refusal)
        elif req.sampling_params.grammar is not None:  # it waits in the grammar queue until it is compiled
            self.grammars.append(req)
        else:
            self._ready(req)

    def _take_adapter(self, req: Req) -> FinishReason | None:
        """Bind a request to its LoRA adapter's current load (a 400 if none is loaded)."""
        try:
            adapters = self._adapters("lora_path")
            adapter = adapters.resolve(cast(str, req.lora_name))
        except AdapterError as exc:
            return FinishReason(type="abort", message=str(exc), status_code=400)
        adapters.acquire(adapter)
        req.lora_id = adapter.id
        return None

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load an adapter (every rank does, in the same order); the reply names a field on failure."""
        try:
            adapter = self._adapters("lora_name").load(name, path)
        except AdapterError as exc:
            return {"error": exc.reason, "field": exc.field}
        return {"success": True, "adapter": adapter.describe()}

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """Unload an adapter: it takes no new requests, and its slot and cached KV go once
        the requests it is serving have finished (at once when there are none)."""
        try:
            self._forget_adapter(self._adapters("lora_name").unload(name))
        except AdapterError as exc:
            return {"error": exc.reason, "field": exc.field}
        return {"success": True}

    def _adapters(self, field_name: str) -> LoRAAdapters:
        """The LoRA adapters; an AdapterError naming ``field_name`` when LoRA is off."""
        if self.runner.lora is None:
            raise AdapterError(field_name, "LoRA is off; start the server with --enable-lora")
        return self.runner.lora

    def _forget_adapter(self, adapter_id: int | None) -> None:
        """An adapter that went (unloaded, its last request done): its cached KV goes too."""
        if adapter_id is not None:
            self.ledger.drop_cached(partial(is_lora_namespace, adapter_id=adapter_id))

    def _ready(self, req: Req) -> None:
        """Queue a request that can be scheduled (its grammar compiled, if it has one)."""
        if req.bootstrap is not None and self.arrivals is not None:
            self.arrivals.add(req)  # its KV comes from the prefill worker
        else:
            self.waiting.append(req)

    def bootstrap_registrations(self) -> list[RoomRegistration]:
        """A prefill worker's rank 0: the rooms decode workers registered since the last
        call, for the process loop to pass to every rank (``register_room``)."""
        return self.handoff.registrations() if self.handoff is not None else []

    def register_room(self, registration: RoomRegistration) -> None:
        if self.handoff is not None:
            self.handoff.register(registration)

    def _cut_to_first_token(self, req: Req) -> None:
        """On the prefill side of a pair a request makes its first token only (the
        decode worker makes the rest)."""
        if self.handoff is not None:
            params = req.sampling_params
            params.max_new_tokens, params.min_new_tokens = 1, min(params.min_new_tokens, 1)

    def _queue_full(self) -> bool:
        """Waiting requests beyond the free running slots are the queue."""
        limit = self.args.max_queued_requests
        free_slots = self.max_running - len(self.running) - (1 if self.chunked_req else 0)
        return limit is not None and len(self.waiting) - max(free_slots, 0) >= limit

    def abort(self, rid: str) -> None:
        """Abort one request (or all with rid ""), wherever it is; frees its memory."""
        targets = list(self._by_rid.values()) if rid == "" else [self._by_rid[rid]] if rid in self._by_rid else []
        computing = {id(r) for step in (self._in_flight, self._unprocessed) if step is not None for r in step.reqs}
        for req in (r for r in targets if not r.finished):
            self._dequeue(req)
            if self.arrivals is not None and self.arrivals.remove(req):
                self.ledger.discard(req)  # its KV had not all come
            elif id(req) in computing:
                self.ledger.discard(req)  # its KV of the step still computing is not worth caching
            else:
                self.ledger.release(req)
            self._finish(req, FinishReason(type="abort", matched=None, message="aborted"))

    # ---- the step pipeline ---------------------------------------------------
    def has_work(self) -> bool:
        return self._busy() or bool(self.grammars) or self._transfers_pending()

    def only_transfers_pending(self) -> bool:
        """Nothing to compute, only KV on its way to or from the other worker of a
        prefill/decode pair: the process loop may wait for messages a moment."""
        return self._transfers_pending() and not (self._busy() or self.grammars)

    def _transfers_pending(self) -> bool:
        return bool(self.handoff) or bool(self.arrivals)

    def _busy(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._in_flight or self._unprocessed)

    def step(self) -> list[TokenOutput]:
        """Launch one model step (an extend batch if one can be formed, else a
        decode batch) and return the outputs to stream.

        Without overlap a step is launched, awaited and digested in one call.
        With overlap, this call's step is launched while the one launched in
        the previous call may still be computing, so the device finds the next
        step queued behind it; then the previous step is awaited and its tokens
        digested while the new one computes. A request that finished in the
        previous step has therefore run one step too many, whose token is dropped.

        A failure inside a step (a bug, a kernel error) ends the requests of
        that batch with an error and frees their memory; the scheduler goes on."""
        with self.rates.measure(self.totals):
            self.grammars.poll(not self._busy(), ready=self._ready, refused=self._finish)
            if self.handoff is not None:
                self.handoff.poll(release=self.ledger.release)
            if self.arrivals is not None:
                self.arrivals.poll(self._open_room, self._kv_arrived, self._kv_failed)
            self._launching = None
            # Rows released so far may still be read by the step in flight: reuse them once it is done.
            held = self.ledger.take_released_rows()
            if self._in_flight is None:
                self.ledger.reuse_rows(held)
                held = []
            try:
                launched = self._launch_next()
            except Exception as exc:
                self.ledger.drop_pins()
                self._step_failed("launching a step", self._launching or self.ledger.holders(), exc)
                launched = None
            self._settle_in_flight()
            self.ledger.reuse_rows(held)
            if launched is not None and self.worker.overlaps:
                self._in_flight = launched
                launched = None
            self._drain()
            if launched is not None:
                self._settle(launched)
                self._drain()
            return self._collect_outputs()

    def step_outputs(self) -> list[TokenOutput]:
        """Outputs pending without a model step (aborted or rejected requests)."""
        return self._collect_outputs()

    def _launch_next(self) -> LaunchedStep | None:
        if self.grammars.constrains(self.running):  # their masks need the last step's tokens: no overlap
            self._digest_outstanding()
        if self.rope_sets.outgrown(self.running):
            self._recompute_outgrown()
        # Requests of a prefill still computing or not digested: their prompts are not cached yet.
        prefills = [
            s
            for s in (self._in_flight, self._unprocessed)
            if s is not None and s.mode is ForwardMode.EXTEND and s.proposals is None
        ]
        uncached = [r for step in prefills for r in step.reqs]
        plan = self.planner.plan(
            QueueView(
                self.waiting, self.running, self.chunked_req, uncached, self.new_token_ratio, self._admitted_adapters()
            )
        )
        self._apply(plan)
        if plan.reqs:
            self._launching = list(plan.reqs)
            with self.profiler.step_scope(lambda: f"extend[tokens={sum(plan.extend_lens)}]"):
                return self._launch_extend(plan)
        if self.running:
            with self.profiler.step_scope(lambda: f"decode[bs={len(self.running)}]"):
                return self._launch_decode()
        return None

    def _settle_in_flight(self) -> None:
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._settle(previous)

    def _settle(self, launched: LaunchedStep) -> None:
        """Wait for a launched step; it becomes the one to digest, or, if it
        failed, its requests end with the error."""
        try:
            launched.result = launched.future.result().wait()
        except Exception as exc:
            self._step_failed("a model step", launched.reqs, exc)
            return
        self._unprocessed = launched

    def _drain(self) -> None:
        """Digest the settled step, if any."""
        launched, self._unprocessed = self._unprocessed, None
        if launched is None:
            return
        try:
            self._process(launched)
        except Exception as exc:  # host work, alike on every rank: ends its requests even with tp > 1
            self._step_failed("digesting a model step", launched.reqs, exc, every_rank_alike=True)

    def _step_failed(self, what: str, reqs: list[Req], exc: Exception, every_rank_alike: bool = False) -> None:
        """End the requests of a failed step with the error; the scheduler goes on. With
        tensor-parallel ranks a device failure ends the process (and its group) instead:
        ranks that failed differently would no longer run the same collectives."""
        if self.runner.group.size > 1 and not every_rank_alike:
            raise exc
        logger.exception("%s failed; ending its requests with an error", what)
        self._fail(reqs, exc)

    # ---- extend ----------------------------------------------------------------
    def _apply(self, plan: PrefillPlan) -> None:
        """Admit the plan's new requests and take them off the waiting queue."""
        for admission in plan.admitted:
            req = admission.req
            self.ledger.admit(req, admission.match)
            self.waiting.remove(req)
            if req.first_admission(admission.match.num_tokens):  # not a retracted request coming back
                self.totals.count_admission(len(req.origin_input_ids), req.cached_tokens)
        self.chunked_req = plan.chunked
        if plan.out_of_memory is not None:
            self._finish_running(plan.out_of_memory, out_of_memory())

    def _launch_extend(self, plan: PrefillPlan) -> LaunchedStep:
        if OperatorLog.enabled():
            cached = sum(r.kv.kv_len for r in cast("list[HoldsKV]", plan.reqs))
            self.oplog.prefill(len(plan.reqs), sum(plan.extend_lens), cached, self.stats(exact=False))
        launched = self._launch(ForwardMode.EXTEND, plan.reqs, plan.extend_lens)
        self.totals.count_extend(sum(plan.extend_lens))
        launched.prompt_done = [r for r, kv in zip(plan.reqs, launched.kv_after, strict=True) if kv == r.seq_len]
        self.running.extend(launched.work.sample_reqs)  # they decode from the next step on
        return launched

    def _launch(
        self, mode: ForwardMode, reqs: list[Req], extend_lens: list[int], proposals: list[list[int]] | None = None
    ) -> LaunchedStep:
        """Allocate the step's KV slots and hand the step to the worker. ``proposals``: a
        verify step's (speculative decoding), an extend of each request's newest token
        and its proposals."""
        held = cast("list[HoldsKV]", reqs)  # admitted: each holds KV
        prefix = [r.kv.kv_len for r in held]
        if proposals is not None:
            logits = LogitsRows.verify(reqs, extend_lens)
        elif mode is ForwardMode.EXTEND:
            logits = LogitsRows.extend(reqs, prefix, extend_lens)
        else:
            logits = LogitsRows.decode(reqs)
        rows, table, transfer = [r.kv.row for r in held], self.runner.req_to_token_pool, self.runner.transfer
        rope = self.rope_sets.row_offsets(reqs)
        lora = self._lora_batch(reqs, extend_lens)
        record = partial(
            BatchPlan.launch, mode, rows, prefix, extend_lens, logits.indices, rope, table, transfer, lora=lora
        )
        batch = self.ledger.allocate(reqs, extend_lens, record)  # the slots go into the rows with the batch
        if proposals is None:
            work = StepWork.of(batch, logits, self.grammars.step_mask(logits.sample_reqs))
        else:
            work = StepWork.verify(batch, reqs, logits, proposals, self.grammars.verify_mask(reqs, proposals))
        kv_after = [r.kv.kv_len for r in held]
        return LaunchedStep(mode, list(reqs), work, self.worker.launch(work), kv_after, proposals=proposals)

    def _lora_batch(self, reqs: list[Req], extend_lens: list[int]) -> LoRABatch | None:
        """The step's adapter slots (multi-LoRA serving), its adapters put in slots now; a
        slot of an adapter an admitted request uses is never taken."""
        if self.runner.lora is None or all(r.lora_id is None for r in reqs):  # a base-model step: no LoRA call
            return None
        return self.runner.lora.batch([r.lora_id for r in reqs], extend_lens, set(self._admitted_adapters()))

    def _admitted_adapters(self) -> frozenset[int]:
        """The LoRA adapters of the requests holding KV: at most ``--max-loras-per-batch``."""
        if self.runner.lora is None:
            return frozenset()
        return frozenset(r.lora_id for r in self.ledger.holders() if r.lora_id is not None)

    def _process(self, launched: LaunchedStep) -> None:
        """Digest a finished step: prompt logprobs, cache the prefilled pages, finish
        prefill-only requests (embeddings), append the sampled tokens and check stop conditions."""
        result, work = cast(StepResult, launched.result), launched.work  # set by _settle
        if launched.proposals is not None:
            self._process_verified(launched, result)
            return
        for rows, (values, tops) in zip(work.prompt_rows, result.prompt_logprobs, strict=True):
            if not rows.req.finished:
                add_input_logprobs(rows.req, values, tops, rows.targets)
        if launched.mode is ForwardMode.EXTEND:
            for req, kv in zip(launched.reqs, launched.kv_after, strict=True):
                if not req.finished:
                    # Prefilled pages go to the cache now, not at the finish, so that waiting
                    # requests with the same prefix (deferred by the planner) match them.
                    self.ledger.cache_prefix(req, kv)
        for req in launched.prompt_done:
            if not req.finished:
                req.mark_prompt_done()
                if req.sampling_params.max_new_tokens == 0:  # prefill only: to warm the cache, or to embed
                    req.embedding = result.embeddings.get(req.rid)
                    self._finish_running(req, FinishReason(type="length", matched=None))
        for i, req in enumerate(work.sample_reqs):
            if not req.finished:  # else aborted, or finished by the step before (overlap): the token is dropped
                self._append(req, result, i)
        if result.hidden_states is not None:
            self._take_features(launched, result.hidden_states)

    def _take_features(self, launched: LaunchedStep, hidden_states: torch.Tensor) -> None:
        """Hand the speculative proposer's EAGLE head the target's hidden states of the
        tokens this (extend or decode) step computed, request by request."""
        speculation = cast(Speculation, self.speculation)  # only an EAGLE head asks for hidden states
        speculating = speculation.speculates_at(len(self.running))
        offset = 0
        for req, n, kv_after in zip(launched.reqs, launched.work.batch.extend_lens, launched.kv_after, strict=True):
            if not req.finished:
                speculation.take_features(req, kv_after - n, hidden_states[offset : offset + n], speculating)
            offset += n

    # ---- decode ----------------------------------------------------------------
    def _launch_decode(self) -> LaunchedStep | None:
        self._make_room_for_decode()
        if not self.running:
            return None
        self._launching = list(self.running)
        proposals = self._proposals()
        if proposals is not None:
            extend_lens = [1 + len(p) for p in proposals]
            launched = self._launch(ForwardMode.EXTEND, self._launching, extend_lens, proposals)
            self.totals.verify_steps += 1
        else:
            launched = self._launch(ForwardMode.DECODE, self._launching, [1] * len(self._launching))
        args = self.args
        self.new_token_ratio = max(self.new_token_ratio - args.new_token_ratio_decay, args.min_new_token_ratio)
        self.totals.count_decode(len(self._launching))
        if self.oplog.due(self.totals.decode_steps) and OperatorLog.enabled():
            self.oplog.decode(self.stats(exact=False))
        return launched

    def _proposals(self) -> list[list[int]] | None:
        """The running requests' proposals (speculative decoding), written into the token
        table after each one's newest token; None (a plain decode step) when speculation
        is off or proposes nothing, or when the pool has no room for the proposals."""
        proposals = self.speculation.proposals(self.running) if self.speculation is not None else None
        if proposals is not None and self.grammars.constrains(self.running):  # proposals a grammar forbids go
            proposals = [self.grammars.allowed_prefix(r, p) for r, p in zip(self.running, proposals, strict=True)]
        if proposals is None or not any(proposals):
            return None
        held = cast("list[HoldsKV]", self.running)
        need = self.ledger.pages_needed([r.kv.kv_len for r in held], [1 + len(p) for p in proposals])
        if need > self.ledger.room() // self.ledger.page_size:
            return None
        table = self.runner.req_to_token_pool
        for req, drafts in zip(held, proposals, strict=True):
            if drafts:
                table.write_tokens(req.kv.row, req.kv.kv_len + 1, drafts)
        return proposals

    def _process_verified(self, launched: LaunchedStep, result: StepResult) -> None:
        """Digest a verify step: each request takes the proposals the model kept and the
        model's own token after them (up to a stop), and gives back the KV of the rest."""
        proposals = cast("list[list[int]]", launched.proposals)
        slots = launched.work.batch.out_cache_loc_cpu
        kept = cast("list[bool]", result.kept)
        first = 0
        for req, drafts, kv_after in zip(launched.reqs, proposals, launched.kv_after, strict=True):
            rows, first = first, first + len(drafts) + 1
            if req.finished:
                continue
            verified = walk(
                rows,
                drafts,
                kept,
                result.next_token_ids,
                result.chosen_logprobs,
                result.proposal_logprobs,
                result.top_logprobs,
            )
            self.totals.count_verified(len(drafts), verified.accepted)
            newest = kv_after - len(drafts) - 1  # the position of its newest token before the step
            taken, reason = 0, None
            for token, logprob, top in zip(verified.tokens, verified.logprobs, verified.top_logprobs, strict=True):
                reason = self._accept_token(req, token, logprob, top if req.top_logprobs_num > 0 else None)
                taken += 1
                if reason is not None:
                    break
            # Computed and kept: its newest token and the proposals taken before the last token.
            self.ledger.trim(req, newest + taken, slots[rows + taken - 1])
            if reason is not None:
                self._finish_running(req, reason)
            else:
                row = cast("HoldsKV", req).kv.row
                self.runner.req_to_token_pool.write_tokens(row, newest + taken, verified.tokens[-1:])
                self.outbox.touch(req)
                if result.hidden_states is not None:  # an EAGLE head's: the kept tokens' hidden states
                    speculation = cast(Speculation, self.speculation)
                    speculation.take_features(req, newest, result.hidden_states[rows : rows + taken], True)

    def _make_room_for_decode(self) -> None:
        """Retract (the chunked prefill first, then the newest requests) until
        every running request can take one more token."""
        while self.running:
            kv_lens = [r.kv.kv_len for r in cast("list[HoldsKV]", self.running)]
            need = self.ledger.pages_needed(kv_lens, [1] * len(self.running))
            if need <= self.ledger.room() // self.ledger.page_size:
                return
            if self._in_flight is not None or self._unprocessed is not None:
                # Digest the last step first: its finished requests free memory, and
                # a retracted request must not have a token still on its way (nor has
                # its grammar matcher: it stays valid, having accepted every output token).
                self._digest_outstanding()
                continue
            if self.chunked_req is not None:
                # A prompt still being prefilled holds pages the decoders need; it steps back first.
                victim, self.chunked_req = self.chunked_req, None
                self._retract(victim)
                continue
            if len(self.running) == 1:
                self._finish_running(self.running[0], out_of_memory())
                return
            victim = max(self.running, key=lambda r: r.arrival)
            self.running.remove(victim)
            self._retract(victim)

    def _digest_outstanding(self) -> None:
        """Wait for and digest every step launched so far."""
        self._drain()
        self._settle_in_flight()
        self._drain()

    def _retract(self, req: Req) -> None:
        """Give back a running request's memory; it requeues first in line and
        resumes from prompt + output so far, producing the same tokens."""
        self.ledger.release(req)
        if not req.input_logprobs_done:  # a partly prefilled prompt recomputes them from the start
            req.input_token_logprobs = req.input_top_logprobs = None
        self.totals.retracted_reqs += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = self.args.init_new_token_ratio
        logger.info("retracted %s after %d tokens (KV pool full)", req.rid, len(req.output_ids))

    def _recompute_outgrown(self) -> None:
        """LongRoPE: requests on the short set about to grow past the original context
        give back their KV (it stays cached in their namespace) and requeue first in
        line, to be computed again from the first token on the long set, as HF does."""
        self._digest_outstanding()  # their last tokens on the host, and which of them finished
        outgrown = self.rope_sets.outgrown(self.running)
        for req in outgrown:
            self.running.remove(req)
            self.ledger.release(req)
            self.rope_sets.choose(req)
        self.waiting[:0] = outgrown

    # ---- results -----------------------------------------------------------------
    def _append(self, req: Req, result: StepResult, row: int) -> None:
        logprob, top = None, None
        if req.return_logprob:
            logprob = cast("list[float]", result.chosen_logprobs)[row]  # present when a request returns logprobs
            top = result.top_logprobs[row] if req.top_logprobs_num > 0 else None
        reason = self._accept_token(req, result.next_token_ids[row], logprob, top)
        if reason is not None:
            self._finish_running(req, reason)
        else:
            self.outbox.touch(req)

    def _accept_token(
        self, req: Req, token: int, logprob: float | None, top: list[tuple[float, int]] | None
    ) -> FinishReason | None:
        """Append a sampled token (with its logprobs, when the request returns them) and
        say whether the request ends with it (stop checks, its grammar)."""
        req.output_ids.append(token)
        self.totals.generation_tokens += 1
        if req.return_logprob:
            req.output_token_logprobs.append((logprob if logprob is not None else 0.0, token))
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(top or [])
        try:
            return self.grammars.accept(req, token, self.stop_checker.check(req.sampling_params, req.output_ids))
        except Exception as exc:  # this request's own fault: end it alone
            logger.exception("stop check failed for %s", req.rid)
            return internal_error(exc)

    def _finish_running(self, req: Req, reason: FinishReason) -> None:
        self._dequeue(req)
        if self.handoff is not None and req.bootstrap is not None and reason.type != "abort" and req.output_ids:
            # Its first token answers its client now; its KV stays until the decode worker has it.
            displaced = self.handoff.hold(req, self.runner.req_to_token_pool.req_to_token)
            if displaced is not None:
                self.ledger.release(displaced)
        else:
            self.ledger.release(req)
        self._finish(req, reason)

    # ---- the decode side of a prefill/decode pair ------------------------------------
    def _open_room(self, req: Req) -> tuple[torch.Tensor, int] | None:
        """Admit a disaggregated request with the prefix its prompt has in the cache here,
        and preallocate KV slots for the rest of its prompt (that KV comes from the prefill
        worker): those slots and the cached count; None while there is no room for it."""
        prompt = len(req.origin_input_ids)
        # At least the last prompt token's KV comes from the prefill worker, as a plain
        # admission computes at least the last token.
        match = self.ledger.match(req.origin_input_ids[: prompt - 1], req.cache_namespace)
        cached = match.num_tokens
        need = self.ledger.pages_needed([cached], [prompt - cached]) * self.ledger.page_size
        holding = len(self.ledger.holders())  # running, being prefilled, waiting for their KV
        if self.ledger.free_rows() < 1 or self.ledger.room() < need or holding >= self.max_running:
            return None
        if not adapter_fits(req, self._admitted_adapters(), self.planner.max_adapters):  # it waits for a slot
            return None
        self.ledger.pin(match)
        self.ledger.admit(req, match)
        table = self.runner.req_to_token_pool
        row = cast("HoldsKV", req).kv.row

        def record(slots: list[int]) -> torch.Tensor:
            written = torch.tensor(slots, dtype=torch.int64, device=table.req_to_token.device)
            table.write(row, cached, written)
            return written

        if req.first_admission(cached):
            self.totals.count_admission(prompt, cached)
        return self.ledger.allocate([req], [prompt - cached], record), cached

    def _kv_arrived(self, req: Req, first: FirstToken) -> None:
        """Its prompt's KV and first token have come: it decodes from the next step on."""
        if first.input_token_logprobs is not None and req.wants_input_logprobs:
            req.input_token_logprobs, req.input_top_logprobs = first.input_token_logprobs, first.input_top_logprobs
        req.mark_prompt_done()
        self.runner.req_to_token_pool.write_tokens(
            cast("HoldsKV", req).kv.row, len(req.origin_input_ids), [first.token]
        )
        reason = self._accept_token(req, first.token, first.logprob, first.top_logprobs)  # a grammar takes it too
        if reason is not None:
            self._finish_running(req, reason)
        else:
            self.running.append(req)
            self.outbox.touch(req)

    def _kv_failed(self, req: Req, reason: FinishReason) -> None:
        self.ledger.discard(req)
        self._finish(req, reason)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        self.grammars.drop(req)
        if req.lora_id is not None and self.runner.lora is not None:
            self._forget_adapter(self.runner.lora.release(req.lora_id))  # an unloaded adapter's last request
        if self.speculation is not None:
            self.speculation.forget(req.rid)
        req.finish_reason = reason
        self.outbox.touch(req)

    def _fail(self, reqs: list[Req], exc: Exception) -> None:
        """End ``reqs`` with an internal error after a failed step. Their KV of this
        step may be half written, so none of it goes to the prefix cache."""
        reason = internal_error(exc)
        for req in (r for r in reqs if not r.finished):
            self._dequeue(req)
            self.ledger.discard(req)
            self._finish(req, reason)

    def _dequeue(self, req: Req) -> None:
        """Take a request out of whichever queue holds it."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None

    def _collect_outputs(self) -> list[TokenOutput]:
        outputs = self.outbox.collect(self._fail_output)
        for out in (o for o in outputs if o.finish_reason is not None):
            self._by_rid.pop(out.rid, None)
        return outputs

    def _fail_output(self, req: Req, exc: Exception) -> None:
        self._fail([req], exc)
        req.finish_reason = internal_error(exc)

    # ---- introspection ---------------------------------------------------------
    def stats(self, exact: bool = True) -> SchedulerStats:
        """``exact``: count the pages whose frees are still on their way to the host
        (waits for the device), check every lock and match the queued prompts against
        the prefix cache (``tokens_to_prefill``); the step logs pass False, and count
        the queued prompts whole."""
        running = len(self.running) + (1 if self.chunked_req else 0)
        awaiting_kv = self.arrivals.requests() if self.arrivals is not None else []
        queued = [*self.waiting, *self.grammars.compiling, *awaiting_kv]
        if exact:
            waiting_tokens = tokens_to_prefill(queued, self.ledger.cached_len)
            chunked = self.chunked_req
            if chunked is not None and chunked.kv is not None:
                waiting_tokens += chunked.seq_len - chunked.kv.kv_len
        else:
            waiting_tokens = sum(r.seq_len for r in queued)
        return SchedulerStats.of(self.totals, self.ledger.counts(exact), running, queued, waiting_tokens, self.rates)

    def check_memory(self) -> bool:
        """The pool invariant: free + held privately by requests + cached == total,
        and the cache's locks are exactly those of the requests holding KV."""
        return self.ledger.counts().ok

    def flush_cache(self) -> bool:
        return not self.has_work() and self.ledger.flush()
