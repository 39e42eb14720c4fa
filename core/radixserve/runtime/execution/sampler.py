"""Batched sampling: one step's ``[B, V]`` logits -> one next token per request.

Every row follows its own request's SamplingParams, in this order:

1. ``logit_bias`` is added;
2. repetition penalty, HF semantics: over prompt + output tokens, a positive
   logit is divided by the penalty and a negative one multiplied;
3. frequency and presence penalties, OpenAI semantics: over output tokens only,
   ``logit -= frequency * count + presence * (count > 0)``;
4. ``min_new_tokens``: until that many tokens exist, the tokens that would end
   the request (``stop_token_ids``, and EOS unless ``ignore_eos``) get -inf;
5. a grammar's token mask (structured output, ``radixserve.structured_output.backend``) sets the
   tokens it forbids to -inf (the elementwise backend's ``apply_token_bitmask``,
   which the ``Sampler`` is given);
6. greedy rows take the argmax; the others divide by the temperature, keep the
   ``top_k`` best, then the smallest set reaching ``top_p``, then drop tokens
   below ``min_p`` times the best one's probability, and draw.

Logprobs are always those of the raw model logits, before any of the above
(a constrained request's too):
what HuggingFace parity tests compare against.

A request with a ``seed`` draws its token at output position ``t`` with a
generator seeded from ``(seed, t)`` alone, so it gets the same tokens whatever
else is in the batch, and again after a retraction. Unseeded rows share one
generator. A batch that is all greedy with nothing to adjust is one argmax.

Two layers: ``SamplingBatch`` + ``sample()`` are the pure core (one step, no
state); ``Sampler`` is the scheduler's entry point, which keeps the RNG and each
running request's token statistics between steps.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from radixserve.kernels.elementwise import apply_token_bitmask
from radixserve.sampling.params import SamplingParams
from radixserve.structured_output.backend import TokenMask
from radixserve.transfer import HostTransfer

# (logits [B, V], bitmask [R, ceil(V / 32)] int32, rows [R] int64) -> None, in place.
MaskLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class TopLogprobs:
    values: torch.Tensor  # [N, k] float32, best first
    ids: torch.Tensor  # [N, k] int64

    def tolist(self) -> list[list[tuple[float, int]]]:
        """Per row, the (logprob, token id) pairs, best first (one device->host copy)."""
        return [list(zip(v, i, strict=True)) for v, i in zip(self.values.tolist(), self.ids.tolist(), strict=True)]


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    chosen_logprobs: torch.Tensor | None = None  # [B] float32, raw logprob of each chosen token
    top_logprobs: TopLogprobs | None = None  # [B, k], k = the largest number asked for

    def top_logprobs_list(self, row: int, k: int) -> list[tuple[float, int]]:
        """The ``k`` best (logprob, token id) of one row, best first."""
        if self.top_logprobs is None or k <= 0:
            return []
        values = self.top_logprobs.values[row, :k].tolist()
        return list(zip(values, self.top_logprobs.ids[row, :k].tolist(), strict=True))


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int = 0
) -> tuple[torch.Tensor, TopLogprobs | None]:
    """``log_softmax(logits)[i, token_ids[i]]`` for each row, and the ``top_k``
    best of each row when asked; the ``[N, V]`` log_softmax is never built.

    For prompt logprobs pass the logits of positions ``p`` and the tokens at
    ``p + 1``."""
    logits = logits.float()
    lse = logits.logsumexp(dim=-1)
    chosen = logits.gather(1, token_ids.reshape(-1, 1).to(logits.device)).squeeze(1) - lse
    if top_k <= 0:
        return chosen, None
    values, ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    return chosen, TopLogprobs(values - lse.unsqueeze(1), ids)


class TokenStats:
    """One request's token history in the form penalties need, on the device.

    Kept across steps: ``update`` counts the outputs a request already has when
    its statistics are created, and every token sampled after that is added on
    the device (``add``), so a step costs nothing per token already counted and
    never waits for the host to learn the previous step's token."""

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, device: torch.device | str):
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if len(prompt_ids):
            self.in_prompt[torch.as_tensor(list(prompt_ids), dtype=torch.int64, device=device)] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.num_output = 0

    def update(self, output_ids: Sequence[int]) -> None:
        """Count ``output_ids[self.num_output:]``, the tokens new since the last call."""
        new = list(output_ids[self.num_output :])
        if new:
            idx = torch.as_tensor(new, dtype=torch.int64, device=self.output_counts.device)
            self.output_counts.index_add_(0, idx, torch.ones(len(new), device=idx.device))
            self.num_output = len(output_ids)

    def with_tokens(self, token_ids: Sequence[int]) -> TokenStats:
        """A copy that also counts ``token_ids`` as outputs (a verify step's row after
        the proposals before it)."""
        counted = copy.copy(self)
        counted.output_counts = self.output_counts.clone()
        counted.num_output = 0
        counted.update(token_ids)
        counted.num_output += self.num_output
        return counted

    def add(self, token_id: torch.Tensor) -> None:
        """Count one sampled token (a 0-d device tensor)."""
        self.output_counts.index_add_(0, token_id.reshape(1), torch.ones(1, device=self.output_counts.device))
        self.num_output += 1


@dataclass
class SamplingBatch:
    """What ``sample`` needs for one step, row ``i`` being request ``i``."""

    params: list[SamplingParams]
    output_lens: list[int]  # tokens each request has generated so far
    token_stats: list[TokenStats | None]  # up to date for rows with penalties, else None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    token_mask: TokenMask | None = None  # the constrained rows' grammar masks

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: Iterable[int] = (),
    ) -> SamplingBatch:
        """From scratch, counting every token (``Sampler`` keeps the counts instead)."""
        stats: list[TokenStats | None] = []
        for p, prompt, output in zip(params, prompt_ids, output_ids, strict=True):
            s = None
            if p.has_penalties:
                s = TokenStats(prompt, vocab_size, device)
                s.update(output)
            stats.append(s)
        return cls(list(params), [len(o) for o in output_ids], stats, frozenset(eos_token_ids))


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    *,
    generator: torch.Generator | None = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    transfer: HostTransfer | None = None,
    mask_logits: MaskLogits = apply_token_bitmask,
) -> SampleOutput:
    """One token per row of ``logits`` ([B, V], on any device). ``generator``
    drives the unseeded rows (None: torch's default one for that device).
    Logprobs are computed only when asked for; ``top_logprobs_num`` implies
    ``return_logprob``. ``logits`` itself is never modified. ``transfer`` moves
    the per-row parameters to the device (default: plain synchronous copies).
    ``mask_logits`` applies ``batch.token_mask`` (default: the torch code)."""
    transfer = transfer or HostTransfer(logits.device)
    raw = logits.float()
    x = adjusted_logits(raw, batch, transfer, mask_logits)
    sampled = [i for i, p in enumerate(batch.params) if not p.is_greedy]
    if len(sampled) < len(batch.params):
        next_ids = x.argmax(dim=-1)
    else:
        next_ids = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if sampled:
        rows = transfer.to_device(sampled)
        next_ids[rows] = _draw(
            x[rows],
            [batch.params[i] for i in sampled],
            [batch.output_lens[i] for i in sampled],
            generator,
            transfer,
        )
    out = SampleOutput(next_ids)
    if return_logprob or top_logprobs_num > 0:
        out.chosen_logprobs, out.top_logprobs = compute_logprobs(raw, next_ids, top_logprobs_num)
    return out


def adjusted_logits(
    raw: torch.Tensor, batch: SamplingBatch, transfer: HostTransfer, mask_logits: MaskLogits = apply_token_bitmask
) -> torch.Tensor:
    """Steps 1-5 of the module docstring; returns ``raw`` itself when all are no-ops.
    Extreme penalties may overflow: no row of the result is NaN or +inf."""
    to_device = transfer.to_device
    bias = [(i, t, b) for i, p in enumerate(batch.params) if p.logit_bias for t, b in p.logit_bias.items()]
    penalized = [i for i, s in enumerate(batch.token_stats) if s is not None]
    blocked = [
        (i, t)
        for i, (p, n) in enumerate(zip(batch.params, batch.output_lens, strict=True))
        if n < p.min_new_tokens
        for t in sorted(set(cast("Iterable[int]", p.stop_token_ids)) | (set() if p.ignore_eos else batch.eos_token_ids))
    ]
    if not (bias or penalized or blocked or batch.token_mask is not None):
        return raw
    x = raw.clone()
    if bias:
        rows, cols, values = zip(*bias, strict=True)
        index = (to_device(rows), to_device(cols))
        x.index_put_(index, to_device(values, x.dtype), accumulate=True)
    if penalized:
        rows_t = to_device(penalized)
        x[rows_t] = _penalize(
            x[rows_t],
            [batch.params[i] for i in penalized],
            cast("list[TokenStats]", [batch.token_stats[i] for i in penalized]),  # the rows whose stats are set
            transfer,
        )
    if blocked:
        rows, cols = zip(*blocked, strict=True)
        x[to_device(rows), to_device(cols)] = float("-inf")
    if batch.token_mask is not None:
        mask_logits(x, batch.token_mask.bitmask, batch.token_mask.rows)
    return x.nan_to_num(nan=float("-inf"), posinf=torch.finfo(x.dtype).max)


def _column(values: list[float], transfer: HostTransfer) -> torch.Tensor:
    return transfer.to_device(values, torch.float32).unsqueeze(1)


def _penalize(
    x: torch.Tensor, params: list[SamplingParams], stats: list[TokenStats], transfer: HostTransfer
) -> torch.Tensor:
    counts = torch.stack([s.output_counts for s in stats])
    in_output = counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.stack([s.in_prompt for s in stats]) | in_output
        factor = torch.where(seen, _column([p.repetition_penalty for p in params], transfer), 1.0)
        x = torch.where(x > 0, x / factor, x * factor)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        x = x - counts * _column([p.frequency_penalty for p in params], transfer)
        x = x - in_output * _column([p.presence_penalty for p in params], transfer)
    return x


def _draw(
    x: torch.Tensor,
    params: list[SamplingParams],
    steps: list[int],
    generator: torch.Generator | None,
    transfer: HostTransfer,
) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p, then one draw per row."""
    device = x.device
    probs = sampling_probs(x, params, transfer)
    seeded = [(j, p.seed) for j, p in enumerate(params) if p.seed is not None]
    if not seeded:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    out = torch.empty(len(params), dtype=torch.int64, device=device)
    unseeded = [j for j, p in enumerate(params) if p.seed is None]
    if unseeded:
        rows = transfer.to_device(unseeded)
        out[rows] = torch.multinomial(probs[rows], 1, generator=generator).squeeze(1)
    for j, seed in seeded:
        out[j] = torch.multinomial(probs[j], 1, generator=step_generator(seed, steps[j], device))[0]
    return out


def sampling_probs(x: torch.Tensor, params: list[SamplingParams], transfer: HostTransfer) -> torch.Tensor:
    """The distribution each row draws from: its adjusted logits ``x`` divided by the
    temperature, then cut to ``top_k``, ``top_p`` and ``min_p``, softmaxed."""
    x = x / _column([p.temperature for p in params], transfer)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        x = _top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params], transfer)
    if any(p.min_p > 0.0 for p in params):
        probs = x.softmax(dim=-1)
        floor = _column([p.min_p for p in params], transfer) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))
    return x.softmax(dim=-1)


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The generator of a seeded request's draws at output position ``step``."""
    g = torch.Generator(device=device)
    g.manual_seed(_step_seed(seed, step))
    return g


def _top_k_top_p(x: torch.Tensor, top_ks: list[int], top_ps: list[float], transfer: HostTransfer) -> torch.Tensor:
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    if any(k > 0 for k in top_ks):
        k = transfer.to_device([k if k > 0 else vocab for k in top_ks]).unsqueeze(1)
        rank = torch.arange(vocab, device=x.device).unsqueeze(0)
        sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
    if any(p < 1.0 for p in top_ps):
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # of the strictly better tokens
        # top_p == 1 keeps everything, whatever the rounding in the cumsum.
        limit = _column([p if p < 1.0 else float("inf") for p in top_ps], transfer)
        sorted_x = sorted_x.masked_fill(mass_before >= limit, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for ``(seed, step)``: the CPU generator keeps only
    32 bits of its seed, so neighbouring seeds and steps must differ in all bits."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step) >> 1


class SamplingRequest(Protocol):
    """What ``Sampler`` reads from a request (runtime/execution/request.py's Req has it)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    return_logprob: bool
    top_logprobs_num: int


class Sampler:
    """The scheduler's sampler: owns the generator of unseeded requests and the
    token statistics of requests with penalties, kept between steps (and
    dropped when the request object is garbage collected)."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        random_seed: int = 0,
        eos_token_ids: Iterable[int] = (),
        transfer: HostTransfer | None = None,
        mask_logits: MaskLogits = apply_token_bitmask,
    ):
        """``mask_logits``: how grammar masks are applied (the model's elementwise
        backend's ``apply_token_bitmask``, a kernel where its plugin has one)."""
        self.vocab_size = vocab_size
        self.mask_logits = mask_logits
        self.device = torch.device(device)
        self.transfer = transfer or HostTransfer(self.device)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(random_seed)
        self._stats: dict[int, tuple[weakref.ref[SamplingRequest], TokenStats]] = {}

    def sample(
        self,
        reqs: Sequence[SamplingRequest],
        logits: torch.Tensor,
        output_lens: Sequence[int] | None = None,
        token_mask: TokenMask | None = None,
    ) -> SampleOutput:
        """One token for each request from its row of ``logits`` ([len(reqs), V]).
        ``output_lens``: tokens each request has generated before this one
        (default ``len(output_ids)``; with overlap scheduling the host learns a
        step's tokens after the next step is launched, so the scheduler counts
        them itself). ``token_mask``: the grammar constraints of the constrained rows.
        Every token sampled here is counted for penalties at once."""
        stats = [self.token_stats(r) for r in reqs]
        batch = SamplingBatch(
            params=[r.sampling_params for r in reqs],
            output_lens=list(output_lens) if output_lens is not None else [len(r.output_ids) for r in reqs],
            token_stats=stats,
            eos_token_ids=self.eos_token_ids,
            token_mask=token_mask,
        )
        top = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        out = sample(
            logits,
            batch,
            generator=self.generator,
            return_logprob=any(r.return_logprob for r in reqs),
            top_logprobs_num=top,
            transfer=self.transfer,
            mask_logits=self.mask_logits,
        )
        for i, s in enumerate(stats):
            if s is not None:
                s.add(out.next_token_ids[i])
        return out

    def prompt_logprobs(
        self, logits: torch.Tensor, target_ids: Sequence[int], top_logprobs_num: int = 0
    ) -> tuple[list[float], list[list[tuple[float, int]]]]:
        """Logprob of ``target_ids[i]`` under ``logits[i]`` ([T, V]) and, per row, the
        top ``top_logprobs_num`` (logprob, token id) pairs (empty lists when 0)."""
        ids = torch.tensor(list(target_ids), dtype=torch.int64, device=logits.device)
        values, top = compute_logprobs(logits, ids, top_logprobs_num)
        return values.tolist(), top.tolist() if top is not None else [[] for _ in target_ids]

    def token_stats(self, req: SamplingRequest) -> TokenStats | None:
        if not req.sampling_params.has_penalties:
            return None
        key = id(req)
        entry = self._stats.get(key)
        if entry is None or entry[0]() is not req:

            def forget(_: weakref.ref[SamplingRequest], key: int = key) -> None:
                self._stats.pop(key, None)

            ref = weakref.ref(req, forget)
            entry = self._stats[key] = (ref, TokenStats(req.origin_input_ids, self.vocab_size, self.device))
        # Outputs it has not counted: from before (a request resumed after retraction), or
        # those of a verify step, which counts none itself. Sampled tokens are counted on the
        # device at once (``add``), so with overlap the host's list is behind, never ahead.
        entry[1].update(req.output_ids)
        return entry[1]
