"""The scheduler: waiting queue -> policy -> extend or decode batch -> model ->
sampler -> results. Usable in-process, one ``step()`` at a time (tests, the
offline API's own process) and inside the scheduler process loop
(``runtime/scheduler_process.py``).

Memory rules (see docs/architecture.md): a request's tokens are
``origin_input_ids + output_ids``; the first ``kv_len`` have KV slots in
``req_to_token[req_pool_idx]``; the first ``num_cached`` of those belong to the
prefix cache and are pinned through ``last_node``; the rest are the request's
own pages. At every step boundary: free + private + cached == total.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import GenerationConfig

from radixserve.cache.chunk_cache import ChunkCache
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import ServerArgs
from radixserve.forward_batch import ForwardMode
from radixserve.messages import GenerateRequest, TokenOutput
from radixserve.registry import PluginRegistry, get_registry
from radixserve.request_limits import request_fit_error
from radixserve.runtime.batch import build_forward_batch
from radixserve.runtime.model_runner import ModelRunner
from radixserve.runtime.policy import order_waiting
from radixserve.runtime.req import Req
from radixserve.runtime.sampler import Sampler
from radixserve.runtime.stop import FinishReason, StopChecker

logger = logging.getLogger(__name__)

# Cap on the decode tokens reserved per request when admitting new ones, so a
# huge max_new_tokens does not block admission (SGLang uses the same idea).
RESERVE_CLIP = 4096


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


class Scheduler:
    def __init__(self, args: ServerArgs, model_path: str, tokenizer, registry: Optional[PluginRegistry] = None):
        self.args = args
        self.registry = registry or get_registry()
        self.runner = ModelRunner(args, model_path, self.registry)
        self.tokenizer = tokenizer
        self.page_size = args.page_size
        self.allocator = self.runner.allocator
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.tree = (ChunkCache if args.disable_radix_cache else RadixCache)(self.allocator, self.page_size)
        self.caches_prefixes = not args.disable_radix_cache
        self.max_running = self.runner.max_running_requests
        self.context_length = self.runner.context_length
        eos_ids = _eos_ids(self.runner.hf_config, _generation_config(model_path), tokenizer)
        self.sampler = Sampler(self.runner.vocab_size, self.runner.device, args.random_seed, eos_ids)
        self.stop_checker = StopChecker(tokenizer, eos_ids)

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.new_token_ratio = args.init_new_token_ratio
        self._touched: dict[str, Req] = {}
        self._by_rid: dict[str, Req] = {}
        self.num_retracted_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0

    # ---- intake ------------------------------------------------------------
    def add_request(self, msg: GenerateRequest | Req) -> None:
        req = msg if isinstance(msg, Req) else Req.from_message(msg)
        self._by_rid[req.rid] = req
        error = self._admission_error(req)
        if error is not None:
            self._finish(req, FinishReason(type="abort", message=error, status_code=400))
            return
        if self._queue_full():
            self._finish(req, FinishReason(type="abort", status_code=503, message=(
                f"too many queued requests; --max-queued-requests is {self.args.max_queued_requests}")))
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
        return request_fit_error(len(req.origin_input_ids), req.sampling_params.max_new_tokens,
                                 self.context_length, self.allocator.size, self.page_size)

    def abort(self, rid: str) -> None:
        """Abort one request (or all with rid ""), wherever it is; frees its memory."""
        if rid == "":
            targets = list(self._by_rid.values())
        else:
            targets = [self._by_rid[rid]] if rid in self._by_rid else []
        for req in targets:
            if req.finished:
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            elif req is self.chunked_req:
                self.chunked_req = None
                self._release(req)
            elif req in self.running:
                self.running.remove(req)
                self._release(req)
            self._finish(req, FinishReason(type="abort", matched=None, message="aborted"))

    # ---- the loop ------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def step(self) -> list[TokenOutput]:
        """Run one model step (an extend batch if one can be formed, else a decode
        batch) and return the outputs to stream."""
        extend = self._schedule_extend()
        if extend:
            self._run_extend(extend)
        elif self.running:
            self._run_decode()
        return self._collect_outputs()

    def step_outputs(self) -> list[TokenOutput]:
        """Outputs pending without a model step (aborted or rejected requests)."""
        return self._collect_outputs()

    def run_until_idle(self) -> list[TokenOutput]:
        outputs = self.step_outputs()
        while self.has_work():
            outputs.extend(self.step())
        return outputs

    # ---- extend ----------------------------------------------------------------
    def _match_limit(self, req: Req) -> int:
        # Leave one token to compute (its logits pick the next token), and stop
        # at logprob_start_len when prompt logprobs must be computed.
        limit = req.seq_len - 1
        if req.wants_input_logprobs:
            limit = min(limit, req.logprob_start_len - 1)
        return max(limit, 0)

    def _prefix_len(self, req: Req) -> int:
        return len(self.tree.match_prefix(req.fill_ids[: self._match_limit(req)]).slots)

    def _reserved_decode_tokens(self) -> float:
        reqs = self.running + ([self.chunked_req] if self.chunked_req else [])
        return sum(min(r.remaining_new_tokens, RESERVE_CLIP) * self.new_token_ratio for r in reqs)

    def _schedule_extend(self) -> list[Req]:
        """Pick the requests to prefill this step (continuing a chunked one first),
        within the free KV (allocator + evictable cache) minus what running
        requests are expected to decode (``new_token_ratio`` of their budget)."""
        if not self.waiting and self.chunked_req is None:
            return []
        ps = self.page_size
        chunk_left = self.args.chunk_size if self.args.chunk_size is not None else float("inf")
        prefill_left = self.args.max_prefill_tokens
        reserved = self._reserved_decode_tokens() * self.args.schedule_conservativeness
        committed = 0.0
        selected: list[Req] = []

        if self.chunked_req is not None:
            req = self.chunked_req
            req.extend_len = self._chunk_len(req.seq_len - req.kv_len, chunk_left)
            pages = self._pages(req.kv_len, req.extend_len) * ps
            if pages > self.allocator.available_size() + self.tree.evictable_size():
                # Already admitted, so it waits for room rather than being
                # judged against new-request budgets; alone, it can never fit.
                req.extend_len = 0
                if not self.running:
                    self.chunked_req = None
                    self._release(req)
                    self._finish(req, FinishReason(type="abort", matched=None,
                                                   message="out of KV cache memory for a single request"))
                return []
            chunk_left -= req.extend_len
            prefill_left -= req.extend_len
            committed += pages
            selected.append(req)
            if chunk_left <= 0 or req.kv_len + req.extend_len < req.seq_len:
                return selected

        for req in order_waiting(self.waiting, self.args.schedule_policy, self._prefix_len):
            if len(self.running) + len(selected) >= self.max_running:
                break
            if self.req_to_token_pool.available_size() == 0 or min(prefill_left, chunk_left) <= 0:
                break
            match = self.tree.match_prefix(req.fill_ids[: self._match_limit(req)])
            prefix = len(match.slots)
            remaining = req.seq_len - prefix
            extend_len = self._chunk_len(remaining, min(chunk_left, prefill_left))
            if extend_len <= 0:
                break
            # Pin the prefix first, so what it held stops counting as evictable room.
            self._lock(match.last_node)
            pages = self._pages(prefix, extend_len) * ps
            reserve = min(req.remaining_new_tokens, RESERVE_CLIP) * self.new_token_ratio
            cost = pages + (reserve if extend_len == remaining else 0)
            room = self.allocator.available_size() + self.tree.evictable_size() - reserved - committed
            # With nothing else running, admit whenever the tokens themselves fit.
            alone = not selected and not self.running
            if cost > room and not (alone and pages <= room + reserved):
                self._unlock(match.last_node)
                break
            committed += cost
            prefill_left -= extend_len
            chunk_left -= extend_len
            self._start(req, match)
            req.extend_len = extend_len
            self.waiting.remove(req)
            selected.append(req)
            if extend_len < remaining:
                self.chunked_req = req
                break
        return selected

    def _chunk_len(self, remaining: int, left: float) -> int:
        if remaining <= left:
            return remaining
        n = int(left)
        if self.page_size > 1 and self.caches_prefixes:
            n -= n % self.page_size  # chunks end on pages so the cache can take them
        return max(n, 0)

    def _pages(self, prefix: int, n: int) -> int:
        return self.allocator.pages_needed([prefix], [n])

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
        req.last_node = match.last_node
        req.kv_len = req.num_cached = prefix
        if req.cached_tokens < 0:
            req.cached_tokens = prefix
            self.prompt_tokens_total += len(req.origin_input_ids)
            self.cached_tokens_total += prefix

    def _alloc(self, reqs: list[Req]) -> torch.Tensor:
        """KV slots for each request's ``extend_len`` new tokens, evicting the
        cache as needed; writes them into the request rows."""
        prefix_lens = [r.kv_len for r in reqs]
        extend_lens = [r.extend_len for r in reqs]
        need = self.allocator.pages_needed(prefix_lens, extend_lens) * self.page_size
        if need > self.allocator.available_size():
            self.tree.evict(need - self.allocator.available_size())
        last_locs = [int(self.req_to_token_pool.req_to_token[r.req_pool_idx, r.kv_len - 1]) if r.kv_len else -1
                     for r in reqs]
        slots = self.allocator.alloc_extend(prefix_lens, last_locs, extend_lens)
        if slots is None:
            raise RuntimeError("KV pool exhausted after admission; the admission budget is wrong")
        offset = 0
        for r in reqs:
            self.req_to_token_pool.write(r.req_pool_idx, r.kv_len, slots[offset : offset + r.extend_len])
            offset += r.extend_len
        return slots

    def _run_extend(self, reqs: list[Req]) -> None:
        slots = self._alloc(reqs)
        logits_indices: list[int] = []
        sample_rows: list[tuple[Req, int]] = []  # request and its row in the logits
        input_rows: list[tuple[Req, int, int, int]] = []  # request, first row, first position, count
        offset = 0
        for req in reqs:
            start, n = req.kv_len, req.extend_len
            if req.wants_input_logprobs:
                # Position p's logits score token p + 1; prompt token t needs row t - 1.
                # This step's rows score tokens start+1 .. start+n.
                first = max(req.logprob_start_len, start + 1)
                last = min(start + n + 1, len(req.origin_input_ids))  # exclusive
                if last > first:
                    input_rows.append((req, len(logits_indices), first, last - first))
                    logits_indices.extend(offset + (t - 1 - start) for t in range(first, last))
            if start + n == req.seq_len:
                sample_rows.append((req, len(logits_indices)))
                logits_indices.append(offset + n - 1)
            offset += n
        batch = build_forward_batch(ForwardMode.EXTEND, reqs, slots, logits_indices, self.req_to_token_pool,
                                    self.runner.kv_pool, self.runner.device)
        logits = self.runner.forward(batch)
        for req, row, first, count in input_rows:
            self._add_input_logprobs(req, logits[row : row + count], req.origin_input_ids[first : first + count])
        for req in reqs:
            req.kv_len += req.extend_len
            req.extend_len = 0
        if self.chunked_req is not None and self.chunked_req.kv_len < self.chunked_req.seq_len:
            self._cache_unfinished(self.chunked_req)
        else:
            self.chunked_req = None
        for req, _ in sample_rows:
            req.input_logprobs_done = True
            if req.return_logprob and req.input_token_logprobs is None and req.logprob_start_len >= 0:
                req.input_token_logprobs, req.input_top_logprobs = [], []
        for req, _ in sample_rows:
            if req.sampling_params.max_new_tokens == 0:  # prefill only (e.g. to warm the cache)
                self._finish_running(req, FinishReason(type="length", matched=None))
        to_sample = [(req, row) for req, row in sample_rows if not req.finished]
        if to_sample:
            rows = torch.tensor([row for _, row in to_sample], device=logits.device)
            self._sample_and_append([r for r, _ in to_sample], logits[rows])
        self.running.extend(req for req, _ in to_sample if not req.finished)

    def _cache_unfinished(self, req: Req) -> None:
        """After a prefill chunk, hand the finished pages to the cache so the next
        chunk (and other requests) can share them."""
        if not self.caches_prefixes:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].clone()
        match = self.tree.cache_unfinished_req(req.fill_ids[: req.kv_len], row, req.last_node, req.num_cached)
        self.req_to_token_pool.write(req.req_pool_idx, 0, match.slots)
        req.num_cached = len(match.slots)
        req.last_node = match.last_node

    # ---- decode ----------------------------------------------------------------
    def _run_decode(self) -> None:
        self._make_room_for_decode()
        if not self.running:
            return
        reqs = self.running
        for req in reqs:
            req.extend_len = 1
        slots = self._alloc(reqs)
        batch = build_forward_batch(ForwardMode.DECODE, reqs, slots, list(range(len(reqs))),
                                    self.req_to_token_pool, self.runner.kv_pool, self.runner.device)
        logits = self.runner.forward(batch)
        for req in reqs:
            req.kv_len += 1
            req.extend_len = 0
        self._sample_and_append(list(reqs), logits)
        self.new_token_ratio = max(self.new_token_ratio - self.args.new_token_ratio_decay, self.args.min_new_token_ratio)

    def _make_room_for_decode(self) -> None:
        """Retract (the chunked prefill first, then the newest requests) until
        every running request can take one more token."""
        while self.running:
            need = self.allocator.pages_needed([r.kv_len for r in self.running], [1] * len(self.running))
            free_pages = (self.allocator.available_size() + self.tree.evictable_size()) // self.page_size
            if need <= free_pages:
                return
            if self.chunked_req is not None:
                # A prompt still being prefilled holds pages the decoders need; it steps back first.
                victim, self.chunked_req = self.chunked_req, None
                self._retract(victim)
                continue
            if len(self.running) == 1:
                req = self.running.pop()
                self._release(req)
                self._finish(req, FinishReason(type="abort", matched=None,
                                               message="out of KV cache memory for a single request"))
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
    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        out = self.sampler.sample(reqs, logits)
        tokens = out.next_token_ids.tolist()
        logprobs = out.chosen_logprobs.tolist() if out.chosen_logprobs is not None else None
        for i, req in enumerate(reqs):
            token = tokens[i]
            req.output_ids.append(token)
            self.generation_tokens_total += 1
            if req.return_logprob:
                req.output_token_logprobs.append((logprobs[i], token))
                if req.top_logprobs_num > 0:
                    req.output_top_logprobs.append(out.top_logprobs_list(i, req.top_logprobs_num))
            reason = self.stop_checker.check(req.sampling_params, req.output_ids)
            if reason is not None:
                self._finish_running(req, reason)
            else:
                self._touched[req.rid] = req

    def _add_input_logprobs(self, req: Req, logits: torch.Tensor, targets: list[int]) -> None:
        if req.input_token_logprobs is None:
            req.input_token_logprobs, req.input_top_logprobs = [], []
            if req.logprob_start_len == 0:
                # The first prompt token has nothing before it to be scored against.
                req.input_token_logprobs.append((None, req.origin_input_ids[0]))
                req.input_top_logprobs.append(None)
        values, tops = self.sampler.prompt_logprobs(logits, targets, req.top_logprobs_num)
        req.input_token_logprobs.extend(zip(values, targets))
        req.input_top_logprobs.extend(tops)

    def _finish_running(self, req: Req, reason: FinishReason) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        self._finish(req, reason)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        self._touched[req.rid] = req

    def _release(self, req: Req) -> None:
        """Return a request's KV: computed pages go to the cache (or back to the
        allocator), the slot row is freed, the prefix is unpinned."""
        if req.req_pool_idx is None:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].clone()
        self.tree.cache_finished_req(req.fill_ids[: req.kv_len], row, req.last_node, req.num_cached)
        self.req_to_token_pool.free(req.req_pool_idx)
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
            outputs.append(self._make_output(req))
            del self._touched[rid]
            if req.finished:
                self._by_rid.pop(rid, None)
        return outputs

    def _make_output(self, req: Req) -> TokenOutput:
        start = req.sent_len
        params = req.sampling_params
        out = TokenOutput(
            rid=req.rid,
            new_token_ids=req.output_ids[start:],
            finish_reason=req.finish_reason.to_dict() if req.finished else None,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=max(req.cached_tokens, 0),
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop_strings=tuple(params.stop or ()),
            no_stop_trim=params.no_stop_trim,
            stream=req.stream,
        )
        if req.return_logprob:
            out.output_token_logprobs = req.output_token_logprobs[start:]
            out.output_top_logprobs = req.output_top_logprobs[start:]
            if req.input_token_logprobs is not None and start == 0:
                out.input_token_logprobs = req.input_token_logprobs
                out.input_top_logprobs = req.input_top_logprobs
        req.sent_len = len(req.output_ids)
        return out

    # ---- introspection ---------------------------------------------------------
    def private_tokens(self) -> int:
        """Slots owned by requests themselves (whole pages), not by the cache."""
        ps = self.page_size
        holders = self.running + ([self.chunked_req] if self.chunked_req else [])
        return sum((-(-r.kv_len // ps) - r.num_cached // ps) * ps for r in holders if r.req_pool_idx is not None)

    def check_memory(self) -> bool:
        """The pool invariant: free + held privately by requests + cached == total."""
        return self.stats().memory_invariant_ok

    def stats(self) -> SchedulerStats:
        free = self.allocator.available_size()
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
