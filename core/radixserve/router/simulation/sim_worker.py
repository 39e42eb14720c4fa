"""A simulated worker: a model of one radixserve worker's scheduler at the level of its
rate curves (``devices.DeviceClass``), not a server.

- Requests wait in arrival order. The head is admitted when the batch has room
  (``max_running``) and KV memory does: its uncached prompt tokens and all its output
  tokens reserved up front, making room by evicting unlocked cached blocks; a request
  behind a blocked head waits too (FCFS).
- Prefill comes first: while admitted prompt tokens are left, a step computes up to
  ``chunk_tokens`` of them, across requests in order (a long prompt is chunked over
  steps). A request's first token comes at the end of the step that finishes its prompt;
  its prompt's blocks then enter the cache (``block_cache``), and its answer's at its end.
- Otherwise the running batch decodes, one token per request a step. The batch does not
  change between one request's end and the next, so a run of decode steps is simulated
  as one span, cut short at the next step boundary when a request arrives.

The measured rates it reports (``load_report``) are the real scheduler's
``StepRates``: prompt (generated) tokens over the seconds of prefill (decode) steps in
the last 30 s of them, overall and per batch-size band (``rate_bands``)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from radixserve.rate_bands import DECODE_BANDS, PREFILL_BANDS, band_index
from radixserve.router.simulation.block_cache import BlockCache
from radixserve.router.simulation.devices import DeviceClass
from radixserve.router.simulation.workload import SimRequest
from radixserve.router.worker import WorkerLoad
from radixserve.runtime.scheduling.stats import RATE_WINDOW_S, StepRate, StepRates


class SimulatedWorker:
    def __init__(self, url: str, device: DeviceClass, block_size: int):
        self.url, self.device = url, device
        self.cache = BlockCache(block_size)
        self.waiting: deque[SimRequest] = deque()  # not fully prefilled, in arrival order
        self.admitted = 0  # of them, those admitted (their KV reserved)
        self.waiting_tokens = 0  # prompt tokens the waiting requests have yet to compute
        self.reserved = 0  # KV tokens the admitted and running requests hold beyond cached blocks
        self.running: list[tuple[int, int, SimRequest]] = []  # (finish step, id, request), a heap
        self.steps = 0  # decode steps run so far
        self._running_prompt = 0  # sum of the running requests' prompt tokens
        self._running_since = 0  # sum of the decode step each started decoding at
        self.chunk: list[tuple[SimRequest, int]] = []  # the prefill step under way: (request, tokens)
        self._span = (0.0, 0.0, 0)  # the decode span under way: (start, seconds a step, steps)
        self.next_wake: float | None = None  # when the step or span under way ends; None: idle
        self.plan = 0  # changes with next_wake (a wake-up planned before is stale)
        self.rates = StepRates(RATE_WINDOW_S)  # fed with the simulated steps' times
        self.requests = self.prompt_tokens = self.cached_tokens = self.output_tokens = 0  # finished ones

    # ---- what the simulator calls ------------------------------------------------------
    def arrive(self, request: SimRequest, now: float) -> None:
        if request.prompt_tokens + request.output_tokens > self.device.kv_tokens:
            raise ValueError(f"request {request.id} needs more KV than {self.url} has ({self.device.kv_tokens})")
        request.worker = self
        self.waiting.append(request)
        self.waiting_tokens += request.prompt_tokens
        if self.next_wake is None:
            self._plan(now)
        elif not self.chunk and len(self.waiting) == 1:
            self._cut_span(now)

    def wake(self, now: float) -> list[SimRequest]:
        """The step or span planned to end now has ended: the requests that finished."""
        finished = self._end_prefill(now) if self.chunk else self._end_span(now)
        self._plan(now)
        return finished

    def load_report(self, now: float) -> WorkerLoad:
        """What its ``/get_load`` would answer now."""
        batch, waiting_tokens = len(self.running), self._tokens_to_prefill()
        return WorkerLoad(
            num_reqs=batch + len(self.waiting),
            num_waiting_reqs=len(self.waiting) - self.admitted,
            num_tokens=self._context() + waiting_tokens,
            num_waiting_tokens=waiting_tokens,
            decode_tokens_per_s=self.rates.decode.tokens_per_s,
            prefill_tokens_per_s=self.rates.prefill.tokens_per_s,
            decode_band_rates=tuple(band.tokens_per_s for band in self.rates.decode_bands),
            decode_band_sizes=tuple(band.tokens_per_step for band in self.rates.decode_bands),
            prefill_band_rates=tuple(band.tokens_per_s for band in self.rates.prefill_bands),
            prefill_band_sizes=tuple(band.tokens_per_step for band in self.rates.prefill_bands),
            reported_at=now,
        )

    def _tokens_to_prefill(self) -> int:
        """As the real scheduler reports them: the waiting prompts' tokens but their cached
        prefixes (matched now for those not admitted yet)."""
        size = self.cache.block_size
        cached = sum(
            min(self.cache.match(r.prompt_keys(size)) * size, r.prompt_tokens - 1)
            for r in itertools.islice(self.waiting, self.admitted, None)
        )
        return self.waiting_tokens - cached

    def kv_in_use(self) -> int:
        return self.cache.tokens + self.reserved

    # ---- prefill -----------------------------------------------------------------------
    def _plan(self, now: float) -> None:
        self.plan += 1
        self.chunk = self._take_chunk()
        if self.chunk:
            tokens = sum(t for _, t in self.chunk)
            self.next_wake = now + self.device.prefill_time(tokens)
        elif self.running:
            batch = len(self.running)
            step = self.device.decode_step_time(batch, self._context())
            steps = self.running[0][0] - self.steps
            self._span = (now, step, steps)
            self.next_wake = now + steps * step
        else:
            self.next_wake = None

    def _take_chunk(self) -> list[tuple[SimRequest, int]]:
        budget, chunk = self.device.chunk_tokens, []
        for position, request in enumerate(self.waiting):
            if position >= self.admitted and not self._admit(request):
                break
            tokens = min(budget, request.prompt_tokens - request.cached_tokens - request.computed_tokens)
            chunk.append((request, tokens))
            budget -= tokens
            if budget == 0:
                break
        return chunk

    def _admit(self, request: SimRequest) -> bool:
        if len(self.running) + self.admitted >= self.device.max_running:
            return False
        keys = request.prompt_keys(self.cache.block_size)
        matched = self.cache.match(keys)
        cached = min(matched * self.cache.block_size, request.prompt_tokens - 1)  # the last token is computed
        need = request.prompt_tokens - cached + request.output_tokens
        self.cache.lock(keys[:matched])
        free = self.device.kv_tokens - self.kv_in_use()
        if need > free + self.cache.evictable_tokens:
            self.cache.unlock(keys[:matched])
            return False
        if need > free:
            self.cache.evict(need - free)
        request.cached_tokens, request.held_kv = cached, need
        request.locked_blocks = matched
        self.reserved += need
        self.waiting_tokens -= cached
        self.admitted += 1
        return True

    def _end_prefill(self, now: float) -> list[SimRequest]:
        tokens = sum(t for _, t in self.chunk)
        band = self.rates.prefill_bands[band_index(PREFILL_BANDS, tokens)]
        _add_step(self.rates.prefill, band, self.device.prefill_time(tokens), tokens)
        self.waiting_tokens -= tokens
        finished = []
        for request, taken in self.chunk:
            request.computed_tokens += taken
            if request.cached_tokens + request.computed_tokens < request.prompt_tokens:
                continue  # chunked: the rest in the next steps
            self.waiting.popleft()
            self.admitted -= 1
            self._cache_prompt(request)
            request.first_token_at = now
            if request.output_tokens == 1:
                finished.append(self._finish(request, now))
            else:
                request.decoding_since = self.steps
                heapq.heappush(self.running, (self.steps + request.output_tokens - 1, request.id, request))
                self._running_prompt += request.prompt_tokens
                self._running_since += self.steps
        self.chunk = []
        return finished

    def _cache_prompt(self, request: SimRequest) -> None:
        """The prompt's full blocks join the cache (locked while it runs); what it holds
        beyond them is its last partial block and its output."""
        block = self.cache.block_size
        keys = request.prompt_keys(block)
        self.cache.lock(keys[request.locked_blocks :])
        request.locked_blocks = len(keys)
        held = request.output_tokens + request.prompt_tokens - len(keys) * block
        self.reserved -= request.held_kv - held
        request.held_kv = held

    # ---- decode ------------------------------------------------------------------------
    def _context(self) -> int:
        """Tokens of context the running batch holds (prompts and tokens generated)."""
        return self._running_prompt + len(self.running) * (1 + self.steps) - self._running_since

    def _cut_span(self, now: float) -> None:
        """A request arrived during a decode span: end it at the next step boundary."""
        start, step, steps = self._span
        done = min(steps, int((now - start) / step) + 1)
        if done < steps:
            self._span = (start, step, done)
            self.next_wake = start + done * step
            self.plan += 1

    def _end_span(self, now: float) -> list[SimRequest]:
        _, step, steps = self._span
        batch = len(self.running)
        band = self.rates.decode_bands[band_index(DECODE_BANDS, batch)]
        _add_step(self.rates.decode, band, steps * step, steps * batch)
        self.steps += steps
        finished = []
        while self.running and self.running[0][0] <= self.steps:
            _, _, request = heapq.heappop(self.running)
            self._running_prompt -= request.prompt_tokens
            self._running_since -= request.decoding_since
            finished.append(self._finish(request, now))
        return finished

    def _finish(self, request: SimRequest, now: float) -> SimRequest:
        """Its prompt and answer's blocks stay cached, unlocked (evictable)."""
        keys = request.sequence_keys(self.cache.block_size)
        self.cache.lock(keys[request.locked_blocks :])
        self.cache.unlock(keys)
        self.reserved -= request.held_kv
        request.held_kv = 0
        request.finished_at = now
        self.requests += 1
        self.prompt_tokens += request.prompt_tokens
        self.cached_tokens += request.cached_tokens
        self.output_tokens += request.output_tokens
        return request


def _add_step(overall: StepRate, band: StepRate, seconds: float, tokens: int) -> None:
    """A step (or a span of equal decode steps) counted as the real scheduler counts it:
    overall, and in the band of its size (a decode step makes a token per request)."""
    overall.add(seconds, tokens)
    band.add(seconds, tokens)
