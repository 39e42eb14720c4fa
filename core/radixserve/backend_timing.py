"""Selection by measurement: when more than one backend of a kind can serve the
model, ``auto`` times each on the model's own shapes and takes the fastest.

A backend's priority is its author's guess, made on one machine. Which kernel
is fastest depends on the machine at hand: on an Intel Xeon with AMX, oneDNN's
GEMM runs ten times faster than our packed AVX-512 kernels, while on an AMD
EPYC without AMX the packed kernels lead at decode sizes. So the candidates that
remain after ``unsupported_reasons`` and ``build`` (registry.usable) are timed:
each GEMM projection at one row, at a decode batch and at a prefill chunk,
attention on a one-request and a batched decode step and an extend step in the
pool's layout, the elementwise ops, the MoE layer and each projection's LoRA
update at those row counts.

A candidate's score weighs each case by the time a workload spends in it, so
that a win on a cheap case cannot outvote a loss on a costly one. Two reference
workloads are priced from the cases: one stream (a request of
``REFERENCE_PROMPT_TOKENS`` prompt tokens prefilled in chunks, then
``REFERENCE_OUTPUT_TOKENS`` one-row decode steps: one user chatting, the
commonest CPU case) and a busy server (the same request's prefill and its share
of the batched decode steps). Each case counts as often as a model step calls it
(the layers' projections once a layer, the LM head once a step). A candidate's
score is the geometric mean, over the two workloads, of its time relative to the
fastest candidate's; candidates within ``TIE_MARGIN`` of the best score are
tied and priority breaks the tie.
The case classes and the inputs they make come from radixserve.kernels.cases,
which the conformance kit builds its cases from too (the serving path never
imports the kit, radixserve.testing).

Results are kept in the user's cache directory, keyed by the platform's
fingerprint (CPU model and ISA flags or device name, threads, library
versions), the candidates and their versions, the shapes and the dtype, so a
second start with the same model on the same machine times nothing.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, cast

import torch

from radixserve.cache.memory_pool import LatentKV
from radixserve.kernels import Backend, KernelQuery
from radixserve.kernels.cases import (
    AttentionCase,
    ElementwiseCase,
    LoRACase,
    MLACase,
    MoECase,
    make_attention_inputs,
    make_elementwise_inputs,
    make_lora_inputs,
    make_mla_inputs,
    make_moe_inputs,
    run_elementwise_case,
    with_kv_layout,
)
from radixserve.registry import Candidate, PluginRegistry
from radixserve.version import __version__

logger = logging.getLogger(__name__)

TIE_MARGIN = 0.03  # scores within 3% of the best are a tie: priority decides
# Per case: at least 3 samples of at least 0.5 ms each, more while under 50 ms in all.
MIN_SAMPLES, MAX_SAMPLES, SAMPLE_SECONDS, MIN_SECONDS = 3, 25, 5e-4, 0.05
# A candidate whose single call takes 20x the best's, and over 50 ms, is not timed further.
# One timed at over 1.5x the best on a case is timed on it again (_second_look).
SECOND_LOOK_FACTOR = 1.5
GIVE_UP_FACTOR, GIVE_UP_FLOOR_SECONDS = 20.0, 0.05
# A GEMM case cycles through copies of its weight totalling this much (at most 64
# copies), more than a CPU's last-level cache, as the layers of a model step do.
COLD_BYTES, MAX_WEIGHT_COPIES = 256 * 2**20, 64
# The request the workloads are priced on (as a chat turn: a long prompt, a shorter answer).
REFERENCE_PROMPT_TOKENS, REFERENCE_OUTPUT_TOKENS = 1024, 256
# The kinds chosen by timing (quantization never is: a checkpoint or the user names it),
# each with the fields of a KernelQuery beyond the device, dtype and heads that a kind's timing
# depends on (its cases read them, or its candidates' kernels may differ by them).
# The others are left out of its cache key: the same model served with another KV
# page size or from another quantized file times no GEMM again.
TIMED_QUERY_FIELDS = {
    "gemm": {"weight_dtype"},
    "attention": {"page_size", "kv_dtype", "sliding_window", "logit_softcap", "mla"},
    "elementwise": {"elementwise_ops"},
    "moe": {"num_experts", "top_k", "quantization", "quantized_checkpoint"},
    "lora": {"max_lora_rank"},
}
_QUERY_BASICS = {"device", "dtype", "head_dim", "num_heads", "num_kv_heads"}
TIMED_KINDS = tuple(TIMED_QUERY_FIELDS)
CACHE_SUBDIR = "backend-timings"


@dataclass(frozen=True)
class ModelShapes:
    """One rank's shapes of the model, and the row counts its steps run at."""

    hidden_size: int
    intermediate_size: int  # the MLP the GEMM backend runs (ModelFacts.dense_intermediate_size; 0: none)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    decode_rows: int  # requests in a decode step
    prefill_rows: int  # tokens in a prefill chunk
    decode_context: int  # tokens each decoding request attends to
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    lora_slots: int = 8  # adapters one batch may use (--max-loras-per-batch), where LoRA is served
    num_layers: int = 1  # this rank's decoder layers: each calls every per-layer case once a step

    def phases(self) -> list[tuple[str, int]]:
        """``(phase, rows)`` a step runs at: one request decoding, a decode batch
        (where more than one request runs) and a prefill chunk."""
        batched = [("decode", self.decode_rows)] if self.decode_rows > 1 else []
        return [("single", 1), *batched, ("prefill", self.prefill_rows)]

    def workloads(self) -> dict[str, dict[str, float]]:
        """Per reference workload, the steps of each phase one request costs (see the
        module docstring): its prefill chunks, and its decode steps alone or its share
        of the batched ones."""
        prefill = REFERENCE_PROMPT_TOKENS / self.prefill_rows
        workloads = {"1 stream": {"prefill": prefill, "single": float(REFERENCE_OUTPUT_TOKENS)}}
        if self.decode_rows > 1:
            decode = REFERENCE_OUTPUT_TOKENS / self.decode_rows
            workloads[f"{self.decode_rows} streams"] = {"prefill": prefill, "decode": decode}
        return workloads

    def gemm_shapes(self) -> list[tuple[str, int, int, bool]]:
        """``(name, out_features, in_features, decode_only)`` of each projection."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        shapes = [
            ("qkv_proj", qkv, self.hidden_size, False),
            ("o_proj", self.hidden_size, self.num_heads * self.head_dim, False),
        ]
        if self.intermediate_size:
            shapes += [
                ("gate_up_proj", 2 * self.intermediate_size, self.hidden_size, False),
                ("down_proj", self.hidden_size, self.intermediate_size, False),
            ]
        # Logits are computed for each request's last token only.
        return shapes + [("lm_head", self.vocab_size, self.hidden_size, True)]


@dataclass
class TimingCase:
    """One timed call: ``setup(backend)`` makes the inputs and returns the call,
    which a model step at ``phase`` (ModelShapes.phases) makes ``calls_per_step`` times."""

    label: str
    setup: Callable[[Any], Callable[[], Any]]
    phase: str
    calls_per_step: int


@dataclass
class KindChoice:
    """How one kind's backend was chosen, for the startup summary and ``/get_server_info``.
    ``describe()`` gives each timed candidate's score (its time on each reference
    workload relative to the fastest candidate's, geometric mean) and those times."""

    kind: str
    chosen: str
    how: str  # "named", "only candidate", "measured", "cached", "priority"
    # Per candidate: per case, the fastest sample's seconds a call (absent where it was not timed further).
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per candidate: per reference workload (ModelShapes.workloads), its seconds for one request.
    workload_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)  # relative to the fastest (1.0)
    notes: dict[str, str] = field(default_factory=dict)  # why a candidate was not timed to the end

    def describe(self) -> str:
        if not self.scores:
            return self.how
        figures = ", ".join(
            f"{name} ({self.notes[name]})"
            if name in self.notes
            else f"{name} {self.scores[name]:.2f}x ({self._times(name)})"
            for name in sorted(self.scores, key=self.scores.__getitem__)
        )
        return f"{self.how}: {figures}"

    def _times(self, name: str) -> str:
        return ", ".join(
            f"{workload} {_duration(seconds)}" for workload, seconds in self.workload_seconds[name].items()
        )


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


# -- the cases -----------------------------------------------------------------


def timing_cases(kind: str, query: KernelQuery, shapes: ModelShapes, device: torch.device) -> list[TimingCase]:
    """What ``kind``'s candidates are timed on: the model's shapes at a decode step and a prefill chunk."""
    builders = {
        "gemm": _gemm_cases,
        "attention": _attention_cases,
        "elementwise": _elementwise_cases,
        "moe": _moe_cases,
        "lora": _lora_cases,
    }
    return builders[kind](query, shapes, device)


def _gemm_cases(query: KernelQuery, shapes: ModelShapes, device: torch.device) -> list[TimingCase]:
    cases = []
    for name, out_features, in_features, decode_only in shapes.gemm_shapes():
        calls = 1 if name == "lm_head" else shapes.num_layers
        for phase, rows in shapes.phases():
            if decode_only and phase == "prefill":
                continue

            def setup(
                backend: Any, rows: int = rows, out_features: int = out_features, in_features: int = in_features
            ) -> Callable[[], Any]:
                gen = torch.Generator().manual_seed(rows + out_features)
                x = torch.randn((rows, in_features), generator=gen).to(device, query.dtype)
                w = torch.randn((out_features, in_features), generator=gen) / math.sqrt(in_features)
                if query.weight_dtype is not None:  # the checkpoint's values, as the model's weights hold them
                    w = w.to(query.weight_dtype)
                w = w.to(device, query.dtype)
                # In a model step each layer's weight arrives cold from memory (the weights
                # outgrow the caches); calls cycle through copies that outgrow them too.
                copies = max(1, min(MAX_WEIGHT_COPIES, math.ceil(COLD_BYTES / (w.numel() * w.element_size()))))
                weights = itertools.cycle([backend.prepare_weight(w.clone()) for _ in range(copies)])
                return lambda: backend.linear(x, next(weights))

            cases.append(TimingCase(f"{name}/{phase}/m{rows}", setup, phase, calls))
    return cases


def _decode_phases(shapes: ModelShapes) -> list[tuple[str, int]]:
    return [(phase, rows) for phase, rows in shapes.phases() if phase != "prefill"]


def _attention_cases(query: KernelQuery, shapes: ModelShapes, device: torch.device) -> list[TimingCase]:
    if query.mla is not None:
        return _mla_attention_cases(query, query.mla, shapes, device)
    context = shapes.decode_context
    # The model's widest sliding window and its logit cap, if it has them (a windowed
    # decode reads far fewer keys; a cap may take another path).
    features: dict[str, Any] = dict(sliding_window=query.sliding_window, logit_softcap=query.logit_softcap)
    suffix = "".join(f"/{k}{v:g}" for k, v in (("window", query.sliding_window), ("softcap", query.logit_softcap)) if v)
    heads = (query.page_size, shapes.num_heads, shapes.num_kv_heads, shapes.head_dim)
    steps = [
        (
            phase,
            AttentionCase(
                f"decode/bs{rows}/ctx{context}{suffix}",
                "decode",
                *heads,
                (context - 1,) * rows,
                (1,) * rows,
                **features,
            ),
        )
        for phase, rows in _decode_phases(shapes)
    ]
    steps.append(
        (
            "prefill",
            AttentionCase(
                f"extend/t{shapes.prefill_rows}{suffix}", "extend", *heads, (0,), (shapes.prefill_rows,), **features
            ),
        )
    )
    cases = []
    for phase, step in steps:

        def setup(backend: Any, step: AttentionCase = step) -> Callable[[], Any]:
            # The pool in the KV cache dtype and the layout the backend reads; q, k, v in the model's dtype.
            inputs = make_attention_inputs(step, query.kv_dtype or query.dtype, device, layout="contiguous")
            inputs.batch.kv_pool = with_kv_layout(inputs.batch.kv_pool, backend.kv_layout)
            q, k, v = (t.to(query.dtype) for t in (inputs.q, inputs.k, inputs.v))

            def call() -> Any:
                backend.init_forward_metadata(inputs.batch)
                return backend.forward(q, k, v, inputs.layer, inputs.batch)

            return call

        cases.append(TimingCase(step.name, setup, phase, shapes.num_layers))
    return cases


def _mla_attention_cases(
    query: KernelQuery, mla: LatentKV, shapes: ModelShapes, device: torch.device
) -> list[TimingCase]:
    """The same two steps for multi-head latent attention, over a latent pool
    (``make_mla_inputs`` of radixserve/kernels/cases/mla.py). The value head is
    timed as wide as the key's non-rotary part (``head_dim - rope_dim``), as in
    DeepSeek-V2: the query does not carry it, and it sizes only the value side
    of the latent's up-projection and of the output's ``W_UV`` product."""
    nope = shapes.head_dim - mla.rope_dim
    dims = (mla.kv_lora_rank, nope, mla.rope_dim, nope)
    context, heads = shapes.decode_context, (query.page_size, shapes.num_heads, *dims)
    steps = [
        (phase, MLACase(f"decode/bs{rows}/ctx{context}", "decode", *heads, (context - 1,) * rows, (1,) * rows))
        for phase, rows in _decode_phases(shapes)
    ]
    steps.append(("prefill", MLACase(f"extend/t{shapes.prefill_rows}", "extend", *heads, (0,), (shapes.prefill_rows,))))
    cases = []
    for phase, step in steps:

        def setup(backend: Any, step: MLACase = step) -> Callable[[], Any]:
            # The pool in the KV cache dtype; the queries, new entries and weight in the model's dtype.
            inputs = make_mla_inputs(step, query.kv_dtype or query.dtype, device, layout="contiguous")
            q_nope, q_rope, latent, k_rope, kv_b = (
                t.to(query.dtype)
                for t in (inputs.q_nope, inputs.q_rope, inputs.latent, inputs.k_rope, inputs.kv_b_weight)
            )

            def call() -> Any:
                backend.init_forward_metadata(inputs.batch)
                return backend.forward_mla(q_nope, q_rope, latent, k_rope, kv_b, inputs.layer, inputs.batch)

            return call

        cases.append(TimingCase(step.name, setup, phase, shapes.num_layers))
    return cases


def _elementwise_cases(query: KernelQuery, shapes: ModelShapes, device: torch.device) -> list[TimingCase]:
    # the norm and the activation the model calls (Gemma's where it names them)
    model_ops = query.elementwise_ops or ()
    norm = "gemma_rms_norm" if "gemma_rms_norm" in model_ops else "rms_norm"
    act = "gelu_tanh_and_mul" if "gelu_tanh_and_mul" in model_ops else "silu_and_mul"
    cases = []
    for phase, rows in shapes.phases():
        ops = [
            ElementwiseCase(f"{norm}/{phase}/m{rows}", norm, rows, hidden=shapes.hidden_size, residual=True),
            ElementwiseCase(
                f"rotary/{phase}/m{rows}",
                "rotary",
                rows,
                heads=shapes.num_heads,
                kv_heads=shapes.num_kv_heads,
                head_dim=shapes.head_dim,
                strided=True,
            ),
        ]
        if shapes.intermediate_size:
            ops.append(ElementwiseCase(f"{act}/{phase}/m{rows}", act, rows, hidden=shapes.intermediate_size))
        for op in ops:

            def setup(backend: Any, op: ElementwiseCase = op) -> Callable[[], Any]:
                inputs = make_elementwise_inputs(op, query.dtype, device)
                return lambda: run_elementwise_case(backend, op, inputs)

            # Two norms a layer (before attention and before the MLP); one rotary and one activation.
            calls = 2 * shapes.num_layers if op.op == norm else shapes.num_layers
            cases.append(TimingCase(op.name, setup, phase, calls))
    return cases


def _moe_cases(query: KernelQuery, shapes: ModelShapes, device: torch.device) -> list[TimingCase]:
    cases = []
    for phase, rows in shapes.phases():
        case = MoECase(
            f"moe/{phase}/m{rows}",
            rows,
            shapes.hidden_size,
            shapes.moe_intermediate_size,
            shapes.num_experts,
            shapes.top_k,
            True,
        )

        def setup(backend: Any, case: MoECase = case) -> Callable[[], Any]:
            hidden, logits, w13, w2, routing = (
                t.to(device) if isinstance(t, torch.Tensor) else t for t in make_moe_inputs(case, query.dtype)
            )
            return lambda: backend.forward(hidden, logits, w13, w2, routing)

        cases.append(TimingCase(case.name, setup, phase, shapes.num_layers))
    return cases


LORA_PREFILL_REQUESTS = 4  # a prefill chunk's requests, each on its own slot


def _lora_out_splits(shapes: ModelShapes) -> dict[str, tuple[int, ...]]:
    """The projections that carry adapters and their fused projections' output rows on
    this rank (a's rows: max_lora_rank times how many)."""
    q, kv, inter = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim, shapes.intermediate_size
    splits: dict[str, tuple[int, ...]] = {"qkv_proj": (q, kv, kv), "o_proj": (shapes.hidden_size,)}
    if inter:
        splits |= {"gate_up_proj": (inter, inter), "down_proj": (shapes.hidden_size,)}
    return splits


def _lora_cases(query: KernelQuery, shapes: ModelShapes, device: torch.device) -> list[TimingCase]:
    """Each projection's adapter update at decode steps whose requests take turns
    over the slots (a run of one token each, as adapters interleave in a real batch)
    and at a prefill chunk shared by a few requests on slots of their own."""
    assert query.max_lora_rank is not None
    slots = shapes.lora_slots
    layouts = {phase: ((1,) * rows, tuple(i % slots for i in range(rows))) for phase, rows in _decode_phases(shapes)}
    requests = min(slots, LORA_PREFILL_REQUESTS, shapes.prefill_rows)
    share, extra = divmod(shapes.prefill_rows, requests)
    layouts["prefill"] = (tuple(share + 1 if i < extra else share for i in range(requests)), tuple(range(requests)))
    out_splits = _lora_out_splits(shapes)
    cases = []
    for name, out_features, in_features, _ in shapes.gemm_shapes():
        if name not in out_splits:
            continue
        for phase, (counts, request_slots) in layouts.items():
            case = LoRACase(
                f"{name}/{phase}/m{sum(counts)}",
                counts,
                request_slots,
                in_features,
                out_features,
                query.max_lora_rank,
                slots,
                fused=len(out_splits[name]),
                out_splits=out_splits[name],
            )

            def setup(backend: Any, case: LoRACase = case) -> Callable[[], Any]:
                x, out, a, b, batch, splits = make_lora_inputs(case, query.dtype, device)
                b.zero_()  # each call then adds nothing: out stays finite over any number of calls
                return lambda: backend.apply(x, out, a, b, batch, splits)

            cases.append(TimingCase(case.name, setup, phase, shapes.num_layers))
    return cases


# -- timing --------------------------------------------------------------------


def time_call(call: Callable[[], Any], synchronize: Callable[[], None], give_up_after: float) -> tuple[float, bool]:
    """Seconds per call of ``call``: after one warm-up call (first-call work:
    compilation, caches), samples of enough back-to-back calls to last
    ``SAMPLE_SECONDS`` each, and the fastest sample's time per call (a timer on a
    shared machine only ever reads too slow: a preempted thread stalls a whole
    parallel region). ``(seconds, False)`` when one call already took longer
    than ``give_up_after``."""
    call()
    synchronize()
    calls_per_sample, spent = 1, 0.0
    samples: list[float] = []
    while len(samples) < MIN_SAMPLES or (spent < MIN_SECONDS and len(samples) < MAX_SAMPLES):
        start = time.perf_counter()
        for _ in range(calls_per_sample):
            call()
        synchronize()
        elapsed = time.perf_counter() - start
        spent += elapsed
        if calls_per_sample == 1 and elapsed > give_up_after:
            return elapsed, False
        if elapsed < SAMPLE_SECONDS and not samples:  # too short to time well: batch more calls per sample
            calls_per_sample = min(1000, calls_per_sample * max(2, math.ceil(SAMPLE_SECONDS / max(elapsed, 1e-7))))
            continue
        samples.append(elapsed / calls_per_sample)
    return min(samples), True


def measure(
    kind: str,
    candidates: list[Candidate],
    query: KernelQuery,
    cases: list[TimingCase],
    workloads: dict[str, dict[str, float]],
    synchronize: Callable[[], None],
) -> KindChoice:
    """Time every candidate on every case, price ``workloads`` (per workload, the
    steps of each phase: ModelShapes.workloads) and choose (see the module docstring)."""
    choice = KindChoice(kind, chosen="", how="measured")
    best: dict[str, float] = {}
    backends: dict[str, Any] = {}
    for cand in candidates:
        seconds: dict[str, float] = {}
        choice.seconds[cand.name] = seconds
        try:
            backend = backends[cand.name] = cand.cls(query)
        except Exception as exc:  # it said it supports the query, then could not be made: not a candidate
            choice.notes[cand.name] = f"failed to construct: {type(exc).__name__}: {exc}"
            logger.warning("%s backend %s failed to construct: %s", kind, cand.name, exc)
            continue
        for case in cases:
            limit = max(GIVE_UP_FACTOR * best.get(case.label, math.inf), GIVE_UP_FLOOR_SECONDS)
            try:
                elapsed, finished = time_call(case.setup(backend), synchronize, limit)
            except Exception as exc:  # it supports the query but fails on these shapes: not a candidate
                choice.notes[cand.name] = f"failed on {case.label}: {type(exc).__name__}: {exc}"
                logger.warning("%s backend %s failed while timed on %s: %s", kind, cand.name, case.label, exc)
                break
            if not finished:
                choice.notes[cand.name] = f"over {GIVE_UP_FACTOR:g}x the fastest on {case.label}; not timed further"
                break
            seconds[case.label] = elapsed
            best[case.label] = min(elapsed, best.get(case.label, math.inf))
    timed = [c.name for c in candidates if c.name not in choice.notes]
    _second_look(cases, {name: backends[name] for name in timed}, choice.seconds, best, synchronize)
    for name in timed:
        seconds = choice.seconds[name]
        choice.workload_seconds[name] = {
            workload: sum(steps.get(c.phase, 0.0) * c.calls_per_step * seconds[c.label] for c in cases)
            for workload, steps in workloads.items()
        }
    fastest = {w: min(choice.workload_seconds[name][w] for name in timed) for w in workloads} if timed else {}
    for cand in candidates:
        if cand.name in choice.notes:
            choice.scores[cand.name] = math.inf
        else:
            times = choice.workload_seconds[cand.name]
            choice.scores[cand.name] = math.exp(statistics.fmean(math.log(times[w] / fastest[w]) for w in workloads))
    choice.chosen = _winner(candidates, choice.scores)
    return choice


def _second_look(
    cases: list[TimingCase],
    backends: dict[str, Any],
    seconds: dict[str, dict[str, float]],
    best: dict[str, float],
    synchronize: Callable[[], None],
) -> None:
    """A timer on a shared machine only ever reads too slow, and a burst of load (a
    process starting beside this one: the server's own, at startup) can cover every
    sample of a case, as a call whose threads wait for a preempted one takes a whole
    time slice. Each case a candidate was timed on at over ``SECOND_LOOK_FACTOR`` x the
    fastest is timed again, after all the others; the faster reading counts."""
    for name, backend in backends.items():
        for case in cases:
            if seconds[name][case.label] > SECOND_LOOK_FACTOR * best[case.label]:
                again, _ = time_call(case.setup(backend), synchronize, math.inf)
                seconds[name][case.label] = min(seconds[name][case.label], again)
                best[case.label] = min(best[case.label], again)


def _winner(candidates: list[Candidate], scores: dict[str, float]) -> str:
    """The highest-priority candidate (``candidates`` are in priority order)
    whose score is within TIE_MARGIN of the best."""
    best = min(scores.values())
    if math.isinf(best):
        raise RuntimeError("every candidate failed while being timed: " + ", ".join(scores))
    return next(c.name for c in candidates if scores[c.name] <= best * (1 + TIE_MARGIN))


# -- the cache -----------------------------------------------------------------


def cache_dir() -> Path:
    """``$RADIXSERVE_CACHE_DIR/backend-timings``, else the user cache directory's."""
    override = os.environ.get("RADIXSERVE_CACHE_DIR")
    if override:
        return Path(override) / CACHE_SUBDIR
    import platformdirs

    return Path(platformdirs.user_cache_dir("radixserve")) / CACHE_SUBDIR


class TimingCache:
    """One JSON file per key (its SHA-256) under ``cache_dir()``; a file that cannot
    be read or written is a miss, logged, never an error."""

    def __init__(self, directory: Path | None = None):
        self.directory = Path(directory) if directory is not None else cache_dir()

    def path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.directory / f"{digest}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        path = self.path(key)
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the unreadable backend timing cache %s: %s", path, exc)
            return None
        return entry if entry.get("key") == key else None

    def put(self, key: dict[str, Any], choice: KindChoice) -> None:
        path = self.path(key)
        entry = {"key": key, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "choice": _choice_json(choice)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entry, indent=1))
            tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError as exc:
            logger.warning("could not write the backend timing cache %s: %s", path, exc)

    def entries(self) -> list[dict[str, Any]]:
        """Every readable entry, newest first (for ``radixserve plugins``)."""
        found = []
        for path in sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return found


def _choice_json(choice: KindChoice) -> dict[str, Any]:
    data = asdict(choice)
    data["scores"] = {k: (None if math.isinf(v) else v) for k, v in choice.scores.items()}
    return data


def _choice_from_json(data: dict[str, Any]) -> KindChoice:
    data = dict(data)
    data["scores"] = {k: (math.inf if v is None else v) for k, v in data["scores"].items()}
    return KindChoice(**data)


# -- selection -------------------------------------------------------------------


class MeasuredSelection:
    """Chooses each kind's backend for ModelContext.create, as ``registry.select``
    does, except that ``auto`` with more than one usable candidate times them.
    ``choices`` keeps how each kind was chosen."""

    def __init__(
        self,
        registry: PluginRegistry,
        platform: Any,
        device_index: int,
        shapes: ModelShapes,
        cache: TimingCache | None = None,
        measure_backends: bool = True,
    ):
        self.registry = registry
        self.platform = platform
        self.device_index = device_index
        self.device = platform.device(device_index)
        self.shapes = shapes
        self.cache = cache if cache is not None else TimingCache()
        self.measure_backends = measure_backends
        self.choices: dict[str, KindChoice] = {}

    def select(self, kind: str, query: KernelQuery, requested: str = "auto") -> type:
        if requested != "auto":
            cls = self.registry.forced(kind, query, requested)
            self.choices[kind] = KindChoice(kind, cast("type[Backend]", cls).name, "named")
            return cls
        usable = self.registry.usable(kind, query)
        # A negative priority keeps a backend out of the race: it is chosen by name, or when nothing else serves.
        contenders = [c for c in usable if c.priority >= 0] or usable[:1]
        if len(contenders) == 1 or kind not in TIMED_KINDS or not self.measure_backends:
            how = "only candidate" if len(contenders) == 1 else "priority"
            self.choices[kind] = KindChoice(kind, contenders[0].name, how)
            return contenders[0].cls
        choice = self._cached_or_measured(kind, query, contenders)
        self.choices[kind] = choice
        logger.info("%s backend %s (%s)", kind, choice.chosen, choice.describe())
        return next(c.cls for c in contenders if c.name == choice.chosen)

    def _cached_or_measured(self, kind: str, query: KernelQuery, usable: list[Candidate]) -> KindChoice:
        key = self._key(kind, query, usable)
        entry = self.cache.get(key)
        if entry is not None:
            choice = _choice_from_json(entry["choice"])
            choice.how = f"cached, measured {entry['measured_at']}"
            return choice
        start = time.perf_counter()
        cases = timing_cases(kind, query, self.shapes, self.device)
        with torch.inference_mode(), self.platform.forward_context():
            choice = measure(
                kind, usable, query, cases, self.shapes.workloads(), lambda: self.platform.synchronize(self.device)
            )
        choice.how = f"measured in {time.perf_counter() - start:.1f} s"
        self.cache.put(key, choice)
        return choice

    def _key(self, kind: str, query: KernelQuery, usable: list[Candidate]) -> dict[str, Any]:
        plugins = self.registry.plugins
        return {
            "kind": kind,
            "machine": self.platform.timing_fingerprint(self.device_index),
            "query": timed_query(kind, query).describe(),
            "shapes": asdict(self.shapes),
            "candidates": {c.name: f"{c.plugin} {plugins[c.plugin].version or __version__}" for c in usable},
            "versions": {"radixserve": __version__, "torch": torch.__version__},
        }


def timed_query(kind: str, query: KernelQuery) -> KernelQuery:
    """``query`` with the fields that ``kind``'s timing does not depend on at their defaults."""
    ignored: dict[str, Any] = {
        f.name: f.default for f in fields(query) if f.name not in _QUERY_BASICS | TIMED_QUERY_FIELDS[kind]
    }
    return replace(query, **ignored)


class AgreedSelection:
    """Selects the backends another process already chose (tensor-parallel rank 0's
    ``MeasuredSelection.choices``), so every rank runs the same kernels: each one
    must be usable here too (``registry.forced``), else the rank fails to start."""

    def __init__(self, registry: PluginRegistry, choices: dict[str, KindChoice]):
        self.registry = registry
        self.choices = dict(choices)

    def select(self, kind: str, query: KernelQuery, requested: str = "auto") -> type:
        if kind not in self.choices:
            raise ValueError(f"rank 0 chose no {kind} backend, yet this rank needs one for {query.describe()}")
        return self.registry.forced(kind, query, self.choices[kind].chosen)


def report_cached(platform: Any, device_index: int = 0, cache: TimingCache | None = None) -> list[dict[str, Any]]:
    """The cached choices measured on this machine (same fingerprint), newest first:
    ``{"kind", "query", "chosen", "measured_at", "figures"}`` for ``radixserve plugins``."""
    fingerprint = platform.timing_fingerprint(device_index)
    rows = []
    for entry in (cache or TimingCache()).entries():
        key = entry.get("key", {})
        if key.get("machine") != fingerprint:
            continue
        choice = _choice_from_json(entry["choice"])
        rows.append(
            {
                "kind": choice.kind,
                "query": key.get("query"),
                "chosen": choice.chosen,
                "measured_at": entry.get("measured_at"),
                "figures": choice.describe().split(": ", 1)[-1],
            }
        )
    return rows
