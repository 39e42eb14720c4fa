"""The scheduler: waiting queue -> policy -> extend or decode batch -> model ->
sampler -> results. Usable in-process, one ``step()`` at a time (tests, the
offline API's own process) and inside the scheduler process loop
(``runtime/scheduler_process.py``).

Its seams: which requests a step prefills (``prefill_planning.py``), running
a step's forward and sampling (``model_worker.py``, overlapped with the host
work of the next step), building the batch (``batch.py``) and assembling what
is sent about a request (``output_assembly.py``). This module keeps the
request lifecycle and the memory accounting.

Memory rules (see docs/architecture.md): a request's tokens are
``origin_input_ids + output_ids``; the first ``kv_len`` have KV slots in
``req_to_token[req_pool_idx]``; the first ``num_cached`` of those belong to the
prefix cache and are pinned through ``last_node``; the rest are the request's
own pages. At every step boundary: free + private + cached == total.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from transformers import GenerationConfig

from radixserve.cache.chunk_cache import ChunkCache
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import ServerArgs
from radixserve.forward_batch import ForwardMode
from radixserve.messages import FinishReason, GenerateRequest, TokenOutput
from radixserve.registry import PluginRegistry, get_registry
from radixserve.request_limits import request_fit_error, token_ids_error
from radixserve.runtime.batch import BatchPlan
from radixserve.runtime.model_runner import ModelRunner
from radixserve.runtime.model_worker import ModelWorker, PromptLogprobRows, StepResult, StepWork
from radixserve.runtime.output_assembly import add_input_logprobs, error_output, make_output
from radixserve.runtime.prefill_planning import PrefillPlanning
from radixserve.runtime.profiler import StepProfiler
from radixserve.runtime.req import Req
from radixserve.runtime.sampler import Sampler
from radixserve.runtime.stop import StopChecker
from radixserve.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step handed to the worker: its requests, each one's ``kv_len`` once the
    step is done, and (after it is awaited) its result."""

    mode: ForwardMode
    reqs: list[Req]
    work: StepWork
    future: Future
    kv_after: list[int]
    prompt_done: list[Req] = field(default_factory=list)  # whose prompt this step completes
    result: Optional[StepResult] = None


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_queue_reqs: int
    token_usage: float
    cache_hit_rate: float
    num_retracted_reqs: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generation_tokens_total: int
    max_total_tokens: int
    free_tokens: int
    cached_tokens_in_tree: int
    private_tokens: int
    memory_invariant_ok: bool


class Scheduler(PrefillPlanning):
    def __init__(self, args: ServerArgs, model_path: str, tokenizer, registry: Optional[PluginRegistry] = None):
        self.args = args
        self.registry = registry or get_registry()
        self.runner = ModelRunner(args, model_path, self.registry)
        self.tokenizer = tokenizer
        self.page_size = args.page_size
        self.allocator = self.runner.allocator
        self.transfer = self.runner.transfer
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.tree = (ChunkCache if args.disable_radix_cache else RadixCache)(self.allocator, self.page_size)
        self.caches_prefixes = not args.disable_radix_cache
        self.max_running = self.runner.max_running_requests
        self.context_length = self.runner.context_length
        eos_ids = _eos_ids(self.runner.hf_config, _generation_config(model_path), tokenizer)
        self.sampler = Sampler(
            self.runner.vocab_size, self.runner.device, args.random_seed, eos_ids, transfer=self.transfer
        )
        self.stop_checker = StopChecker(tokenizer, eos_ids)

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.new_token_ratio = args.init_new_token_ratio
        self._touched: dict[str, Req] = {}
        overlap = (
            self.runner.platform.overlap_schedule
            if args.disable_overlap_schedule is None
            else not args.disable_overlap_schedule
        )
        self.worker = ModelWorker(self.runner, self.sampler, self.req_to_token_pool, self.transfer, overlap=overlap)
        # One rank per scheduler process (tp_size is 1 so far).
        self.profiler = StepProfiler(self.runner.platform.profiler_activities(), rank=0)
        self._launching: Optional[list[Req]] = None  # the requests of the step being launched
        self._in_flight: Optional[_Launched] = None  # launched, not awaited yet (overlap)
        self._unprocessed: Optional[_Launched] = None  # awaited, tokens not digested yet
        # Token-table rows of ended requests that a launched step may still read and
        # write (overlap: a request that finished in one step runs in the next); they
        # are reused once the steps launched before their release have finished.
        self._released_rows: list[int] = []
        self._by_rid: dict[str, Req] = {}
        self.num_retracted_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_decode_steps = 0
        self._last_decode_log = (time.perf_counter(), 0)  # time, generation_tokens_total

    # ---- intake ------------------------------------------------------------
    def add_request(self, msg: GenerateRequest | Req) -> None:
        """Queue a request, or finish it at once with a 400 (it can never be
        served), a 503 (queue full) or a 400 naming what it got wrong. The
        TokenizerManager checks the same things first; the scheduler guards itself
        so that no message can take it down."""
        try:
            req = msg if isinstance(msg, Req) else Req.from_message(msg)
            error = self._admission_error(req)
        except Exception as exc:  # malformed fields: refuse this request, keep serving
            req = Req(rid=str(msg.rid), origin_input_ids=[], sampling_params=SamplingParams())
            error = f"{exc}" if isinstance(exc, ValueError) else f"invalid request: {type(exc).__name__}: {exc}"
        self._by_rid[req.rid] = req
        if error is not None:
            self._finish(req, FinishReason(type="abort", message=error, status_code=400))
            return
        if self._queue_full():
            self._finish(
                req,
                FinishReason(
                    type="abort",
                    status_code=503,
                    message=(f"too many queued requests; --max-queued-requests is {self.args.max_queued_requests}"),
                ),
            )
            return
        self.waiting.append(req)

    def _queue_full(self) -> bool:
        """Waiting requests beyond the free running slots are the queue."""
        limit = self.args.max_queued_requests
        if limit is None:
            return False
        free_slots = self.max_running - len(self.running) - (1 if self.chunked_req else 0)
        return len(self.waiting) - max(free_slots, 0) >= limit

    def _admission_error(self, req: Req) -> Optional[str]:
        ids = req.origin_input_ids
        error = token_ids_error(ids, self.runner.vocab_size)
        if error is not None:
            return error
        req.sampling_params.validate(self.runner.vocab_size, self.args)  # stop strings included
        return request_fit_error(
            len(ids), req.sampling_params.max_new_tokens, self.context_length, self.allocator.size, self.page_size
        )

    def abort(self, rid: str) -> None:
        """Abort one request (or all with rid ""), wherever it is; frees its memory."""
        if rid == "":
            targets = list(self._by_rid.values())
        else:
            targets = [self._by_rid[rid]] if rid in self._by_rid else []
        computing = {id(r) for step in (self._in_flight, self._unprocessed) if step is not None for r in step.reqs}
        for req in targets:
            if req.finished:
                continue
            self._dequeue(req)
            if id(req) in computing:
                self._discard(req)  # its KV of the step still computing is not worth caching
            else:
                self._release(req)
            self._finish(req, FinishReason(type="abort", matched=None, message="aborted"))

    # ---- the loop ------------------------------------------------------------
    def has_work(self) -> bool:
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
        self._launching = None
        held, self._released_rows = self._released_rows, []
        if self._in_flight is None:
            self._reuse_rows(held)
            held = []
        try:
            launched = self._launch_next()
        except Exception as exc:
            logger.exception("launching a step failed; ending its requests with an error")
            self._fail(self._launching if self._launching is not None else self._holding_memory(), exc)
            launched = None
        self._settle_in_flight()
        self._reuse_rows(held)
        if launched is not None and self.worker.overlaps:
            self._in_flight = launched
            launched = None
        self._drain()
        if launched is not None:
            self._settle(launched)
            self._drain()
        return self._collect_outputs()

    def _launch_next(self) -> Optional[_Launched]:
        extend = self._schedule_extend()
        if extend:
            self._launching = list(extend)
            with self.profiler.step_scope(lambda: f"extend[tokens={sum(r.extend_len for r in extend)}]"):
                return self._launch_extend(extend)
        if self.running:
            with self.profiler.step_scope(lambda: f"decode[bs={len(self.running)}]"):
                return self._launch_decode()
        return None

    def _reuse_rows(self, rows: list[int]) -> None:
        for row in rows:
            self.req_to_token_pool.free(row)

    def _settle_in_flight(self) -> None:
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._settle(previous)

    def _settle(self, launched: _Launched) -> None:
        """Wait for a launched step; it becomes the one to digest, or, if it
        failed, its requests end with the error."""
        try:
            launched.result = launched.future.result().wait()
        except Exception as exc:
            logger.exception("a model step failed; ending its requests with an error")
            self._fail(launched.reqs, exc)
            return
        self._unprocessed = launched

    def _drain(self) -> None:
        """Digest the settled step, if any."""
        launched, self._unprocessed = self._unprocessed, None
        if launched is None:
            return
        try:
            self._process(launched)
        except Exception as exc:
            logger.exception("digesting a model step failed; ending its requests with an error")
            self._fail(launched.reqs, exc)

    def step_outputs(self) -> list[TokenOutput]:
        """Outputs pending without a model step (aborted or rejected requests)."""
        return self._collect_outputs()

    # ---- extend ----------------------------------------------------------------
    def _uncached_prefills(self) -> list[Req]:
        """Requests of a prefill still computing or not digested: their prompts are not cached yet."""
        steps = (self._in_flight, self._unprocessed)
        return [r for step in steps if step is not None and step.mode is ForwardMode.EXTEND for r in step.reqs]

    def _lock(self, node) -> None:
        if node is not None:
            self.tree.inc_lock_ref(node)

    def _unlock(self, node) -> None:
        if node is not None:
            self.tree.dec_lock_ref(node)

    def _start(self, req: Req, match) -> None:
        """Give a waiting request its slot row and pin its cached prefix."""
        req.req_pool_idx = self.req_to_token_pool.alloc()
        prefix = len(match.slots)
        if prefix:
            self.req_to_token_pool.write(req.req_pool_idx, 0, match.slots)
        self.req_to_token_pool.write_tokens(req.req_pool_idx, 0, req.fill_ids)
        req.last_node = match.last_node
        req.kv_len = req.num_cached = prefix
        req.last_slot = -1  # a cached prefix is page aligned
        if req.cached_tokens < 0:
            req.queue_time = time.perf_counter() - req.arrival_time
            req.cached_tokens = prefix
            self.prompt_tokens_total += len(req.origin_input_ids)
            self.cached_tokens_total += prefix

    def _alloc(self, reqs: list[Req]) -> list[int]:
        """KV slots for each request's ``extend_len`` new tokens (in request order),
        evicting the cache as needed. ``BatchPlan.launch`` records them in the
        request rows."""
        prefix_lens = [r.kv_len for r in reqs]
        extend_lens = [r.extend_len for r in reqs]
        need = self.allocator.pages_needed(prefix_lens, extend_lens) * self.page_size
        # Before evicting the cache, wait for the frees still on their way to the host.
        if need > self.allocator.available_size() and need > self.allocator.available_size(wait=True):
            self.tree.evict(need - self.allocator.available_size())
        slots = self.allocator.alloc_slots(prefix_lens, [r.last_slot for r in reqs], extend_lens)
        if slots is None:
            raise RuntimeError("KV pool exhausted after admission; the admission budget is wrong")
        for r, end in zip(reqs, itertools.accumulate(r.extend_len for r in reqs)):
            r.last_slot = slots[end - 1]
        return slots

    def _launch_extend(self, reqs: list[Req]) -> _Launched:
        self._log_prefill(reqs)
        slots = self._alloc(reqs)
        logits_indices: list[int] = []
        prompt_rows: list[PromptLogprobRows] = []
        sample_reqs: list[Req] = []
        sample_rows: list[int] = []
        offset = 0
        for req in reqs:
            start, n = req.kv_len, req.extend_len
            if req.wants_input_logprobs:
                # Position p's logits score token p + 1; prompt token t needs row t - 1.
                # This step's rows score tokens start+1 .. start+n.
                first = max(req.logprob_start_len, start + 1)
                last = min(start + n + 1, len(req.origin_input_ids))  # exclusive
                if last > first:
                    prompt_rows.append(PromptLogprobRows(req, len(logits_indices), req.origin_input_ids[first:last]))
                    logits_indices.extend(offset + (t - 1 - start) for t in range(first, last))
            if start + n == req.seq_len and req.sampling_params.max_new_tokens > 0:
                sample_reqs.append(req)
                sample_rows.append(len(logits_indices))
                logits_indices.append(offset + n - 1)
            offset += n
        batch = BatchPlan.launch(ForwardMode.EXTEND, reqs, slots, logits_indices, self.req_to_token_pool, self.transfer)
        prompt_done = [r for r in reqs if r.kv_len + r.extend_len == r.seq_len]
        launched = self._launch(ForwardMode.EXTEND, reqs, batch, sample_reqs, sample_rows, prompt_rows)
        launched.prompt_done = prompt_done
        if self.chunked_req is not None and self.chunked_req.kv_len >= self.chunked_req.seq_len:
            self.chunked_req = None
        self.running.extend(sample_reqs)  # they decode from the next step on
        return launched

    def _launch(
        self,
        mode: ForwardMode,
        reqs: list[Req],
        batch: BatchPlan,
        sample_reqs: list[Req],
        sample_rows: list[int],
        prompt_rows: Optional[list[PromptLogprobRows]] = None,
    ) -> _Launched:
        """Hand the step to the worker; each request's ``kv_len`` then counts the
        tokens whose KV the step computes. A sampled token goes to position
        ``kv_len`` of its request (the first not yet computed), and the tokens
        generated before it are the ones past the prompt."""
        kv_after = [r.kv_len + r.extend_len for r in reqs]
        after = dict(zip(map(id, reqs), kv_after))
        positions = [after[id(r)] for r in sample_reqs]
        work = StepWork(
            batch,
            sample_reqs,
            sample_rows,
            [r.req_pool_idx for r in sample_reqs],
            [p - len(r.origin_input_ids) for r, p in zip(sample_reqs, positions)],
            positions,
            prompt_rows or [],
        )
        future = self.worker.launch(work)
        for req, kv in zip(reqs, kv_after):
            req.kv_len, req.extend_len = kv, 0
        return _Launched(mode, list(reqs), work, future, kv_after)

    def _process(self, launched: _Launched) -> None:
        """Digest a finished step: prompt logprobs, cache the prefilled pages,
        append the sampled tokens and check stop conditions."""
        result, work = launched.result, launched.work
        for rows, (values, tops) in zip(work.prompt_rows, result.prompt_logprobs):
            if not rows.req.finished:
                add_input_logprobs(rows.req, values, tops, rows.targets)
        for req, kv in zip(launched.reqs, launched.kv_after):
            if launched.mode is ForwardMode.EXTEND and not req.finished:
                # Prefilled pages go to the cache now, not at the finish, so that waiting
                # requests with the same prefix (deferred by _schedule_extend) match them.
                self._cache_prefix(req, kv)
        for req in launched.prompt_done:
            if not req.finished:
                self._prompt_done(req)
        for i, req in enumerate(work.sample_reqs):
            if req.finished:  # aborted, or finished by the step before (overlap): the token is dropped
                continue
            self._append(req, result, i)

    def _prompt_done(self, req: Req) -> None:
        req.input_logprobs_done = True
        if req.return_logprob and req.input_token_logprobs is None and req.logprob_start_len >= 0:
            req.input_token_logprobs, req.input_top_logprobs = [], []
        if req.sampling_params.max_new_tokens == 0:  # prefill only (e.g. to warm the cache)
            self._finish_running(req, FinishReason(type="length", matched=None))

    def _cache_prefix(self, req: Req, computed: int) -> None:
        """Hand a request's first ``computed`` tokens (whole pages of them) to the
        cache, so its next chunk and other requests can share them."""
        if not self.caches_prefixes:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, :computed].clone()
        match = self.tree.cache_unfinished_req(req.fill_ids[:computed], row, req.last_node, req.num_cached)
        self.req_to_token_pool.write(req.req_pool_idx, 0, match.slots)
        req.num_cached = len(match.slots)
        req.last_node = match.last_node

    # ---- decode ----------------------------------------------------------------
    def _launch_decode(self) -> Optional[_Launched]:
        self._make_room_for_decode()
        if not self.running:
            return None
        reqs = list(self.running)
        self._launching = reqs
        for req in reqs:
            req.extend_len = 1
        slots = self._alloc(reqs)
        rows = list(range(len(reqs)))
        batch = BatchPlan.launch(ForwardMode.DECODE, reqs, slots, rows, self.req_to_token_pool, self.transfer)
        launched = self._launch(ForwardMode.DECODE, reqs, batch, reqs, rows)
        self.new_token_ratio = max(
            self.new_token_ratio - self.args.new_token_ratio_decay, self.args.min_new_token_ratio
        )
        self.num_decode_steps += 1
        if self.num_decode_steps % self.args.decode_log_interval == 0:
            self._log_decode()
        return launched

    def _make_room_for_decode(self) -> None:
        """Retract (the chunked prefill first, then the newest requests) until
        every running request can take one more token."""
        while self.running:
            need = self.allocator.pages_needed([r.kv_len for r in self.running], [1] * len(self.running))
            free_pages = (self.allocator.available_size() + self.tree.evictable_size()) // self.page_size
            if need <= free_pages:
                return
            if self._in_flight is not None or self._unprocessed is not None:
                # Digest the last step first: its finished requests free memory, and
                # a retracted request must not have a token still on its way.
                self._drain()
                self._settle_in_flight()
                self._drain()
                continue
            if self.chunked_req is not None:
                # A prompt still being prefilled holds pages the decoders need; it steps back first.
                victim, self.chunked_req = self.chunked_req, None
                self._retract(victim)
                continue
            if len(self.running) == 1:
                req = self.running.pop()
                self._release(req)
                self._finish(
                    req, FinishReason(type="abort", matched=None, message="out of KV cache memory for a single request")
                )
                return
            victim = max(self.running, key=lambda r: r.arrival)
            self.running.remove(victim)
            self._retract(victim)

    def _retract(self, req: Req) -> None:
        """Give back a running request's memory; it requeues first in line and
        resumes from prompt + output so far, producing the same tokens."""
        self._release(req)
        if not req.input_logprobs_done:  # a partly prefilled prompt recomputes them from the start
            req.input_token_logprobs = req.input_top_logprobs = None
        self.num_retracted_total += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = self.args.init_new_token_ratio
        logger.info("retracted %s after %d tokens (KV pool full)", req.rid, len(req.output_ids))

    # ---- results -----------------------------------------------------------------
    def _append(self, req: Req, result: StepResult, row: int) -> None:
        token = result.next_token_ids[row]
        req.output_ids.append(token)
        self.generation_tokens_total += 1
        if req.return_logprob:
            req.output_token_logprobs.append((result.chosen_logprobs[row], token))
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(result.top_logprobs[row])
        try:
            reason = self.stop_checker.check(req.sampling_params, req.output_ids)
        except Exception as exc:  # this request's own fault: end it alone
            logger.exception("stop check failed for %s", req.rid)
            reason = _internal_error(exc)
        if reason is not None:
            self._finish_running(req, reason)
        else:
            self._touched[req.rid] = req

    def _finish_running(self, req: Req, reason: FinishReason) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        self._finish(req, reason)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        self._touched[req.rid] = req

    def _holding_memory(self) -> list[Req]:
        """Requests that may hold KV: running, being prefilled, or in a step not digested yet
        (a prefill-only request is in no queue until then)."""
        steps = [s for s in (self._in_flight, self._unprocessed) if s is not None]
        held = self.running + ([self.chunked_req] if self.chunked_req else [])
        return held + [r for step in steps for r in step.reqs if not r.finished and r.req_pool_idx is not None]

    def _fail(self, reqs: list[Req], exc: Exception) -> None:
        """End ``reqs`` with an internal error after a failed step. Their KV of this
        step may be half written, so none of it goes to the prefix cache."""
        reason = _internal_error(exc)
        for req in reqs:
            if req.finished:
                continue
            self._dequeue(req)
            self._discard(req)
            self._finish(req, reason)

    def _dequeue(self, req: Req) -> None:
        """Take a request out of whichever queue holds it."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None

    def _discard(self, req: Req) -> None:
        """Free a request's own slots (including any allocated this step) without
        caching them, and unpin its cached prefix."""
        if req.req_pool_idx is None:
            return
        end = req.kv_len + req.extend_len
        self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, req.num_cached : end].clone())
        self._unlock(req.last_node)
        self._released_rows.append(req.req_pool_idx)
        req.req_pool_idx, req.kv_len, req.extend_len, req.num_cached, req.last_node = None, 0, 0, 0, None

    def _release(self, req: Req) -> None:
        """Return a request's KV: computed pages go to the cache (or back to the
        allocator), the slot row is freed, the prefix is unpinned."""
        if req.req_pool_idx is None:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].clone()
        self.tree.cache_finished_req(req.fill_ids[: req.kv_len], row, req.last_node, req.num_cached)
        self._released_rows.append(req.req_pool_idx)
        req.req_pool_idx, req.kv_len, req.num_cached, req.last_node = None, 0, 0, None

    def _collect_outputs(self) -> list[TokenOutput]:
        outputs = []
        for rid, req in list(self._touched.items()):
            new = len(req.output_ids) - req.sent_len
            # Streams send every stream_interval tokens; others send their first
            # token (so time-to-first-token is known) and then the rest at the end.
            first = req.sent_len == 0 and new > 0
            if not req.finished and not first and (not req.stream or new < self.args.stream_interval):
                continue
            try:
                outputs.append(make_output(req))
            except Exception as exc:
                logger.exception("assembling the output of %s failed", rid)
                self._fail([req], exc)
                req.finish_reason = _internal_error(exc)
                outputs.append(error_output(req))
            del self._touched[rid]
            if req.finished:
                self._by_rid.pop(rid, None)
        return outputs

    # ---- operator log lines (SGLang's format, so existing dashboards and habits carry over)
    def _log_prefill(self, reqs: list[Req]) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        new_tokens = sum(r.extend_len for r in reqs)
        cached = sum(r.kv_len for r in reqs)
        stats = self.stats(exact=False)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(reqs),
            new_tokens,
            cached,
            stats.token_usage,
            len(self.running),
            len(self.waiting),
        )

    def _log_decode(self) -> None:
        now, tokens = time.perf_counter(), self.generation_tokens_total
        then, before = self._last_decode_log
        self._last_decode_log = (now, tokens)
        stats = self.stats(exact=False)
        used = stats.max_total_tokens - stats.free_tokens - self.tree.evictable_size()
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d",
            len(self.running),
            used,
            stats.token_usage,
            (tokens - before) / max(now - then, 1e-9),
            len(self.waiting),
        )

    # ---- introspection ---------------------------------------------------------
    def private_tokens(self) -> int:
        """Slots owned by requests themselves (whole pages), not by the cache."""
        ps = self.page_size
        holders = {id(r): r for r in self._holding_memory()}.values()
        return sum((-(-r.kv_len // ps) - r.num_cached // ps) * ps for r in holders if r.req_pool_idx is not None)

    def check_memory(self) -> bool:
        """The pool invariant: free + held privately by requests + cached == total."""
        return self.stats().memory_invariant_ok

    def stats(self, exact: bool = True) -> SchedulerStats:
        """``exact``: count the pages whose frees are still on their way to the host
        (waits for the device); the step logs pass False and never wait."""
        free = self.allocator.available_size(wait=exact)
        cached = self.tree.evictable_size() + self.tree.protected_size()
        private = self.private_tokens()
        total = self.allocator.size
        return SchedulerStats(
            num_running_reqs=len(self.running) + (1 if self.chunked_req else 0),
            num_queue_reqs=len(self.waiting),
            token_usage=(total - free - self.tree.evictable_size()) / total,
            cache_hit_rate=self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0,
            num_retracted_reqs=self.num_retracted_total,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            max_total_tokens=total,
            free_tokens=free,
            cached_tokens_in_tree=cached,
            private_tokens=private,
            memory_invariant_ok=free + private + cached == total,
        )

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        return bool(self.tree.reset())


def _internal_error(exc: Exception) -> FinishReason:
    return FinishReason(type="abort", message=f"internal error: {type(exc).__name__}: {exc}", status_code=500)


def _eos_ids(hf_config, generation_config, tokenizer) -> set[int]:
    """EOS ids from the model config, its generation config (e.g. Llama 3's
    <|eot_id|>) and the tokenizer."""
    ids: set[int] = set()
    sources = (hf_config, generation_config, tokenizer)
    for source in (getattr(s, "eos_token_id", None) for s in sources):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


def _generation_config(model_path: str):
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:  # the file is optional
        return None
