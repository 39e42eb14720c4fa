"""One command for one NVIDIA GPU, no network, under 10 minutes: radixserve's
Engine on a random-weight bf16 model of Llama-3.1-8B's shape, against HF
transformers ``generate`` as a baseline.

    python benchmarks/bench_gpu.py                       # 8B shape on cuda
    python benchmarks/bench_gpu.py --json                # ... and the results as one JSON line
    python benchmarks/bench_gpu.py --shape tiny --device cpu   # a smoke run of the whole script

It writes the model (safetensors, weights drawn on the device) and a word-level
tokenizer of the model's vocabulary into a temporary directory, then measures,
through the Engine (offline, page size 16, greedy, fixed output lengths):

- batch-1 latency: a 128-token prompt -> 256 tokens, one request at a time;
  milliseconds per output token = end-to-end latency / output tokens;
- offline throughput: 64 and 256 prompts of 128-512 tokens (uniform) -> 256 tokens each, all at once;
- shared prefix: 8 system prompts x 16 questions (1024 + 64 tokens -> 32), radix cache on and off;
- each of the first two with decode graphs (the default where the platform and
  attention backend capture them) and eagerly (``disable_graph``);
- HF ``generate`` batch-1 latency with a static KV cache (on cuda it compiles
  the forward), the same prompt and output lengths.

``--profile`` then profiles the batch-1 latency run and the first throughput
batch (64 on the 8B shape) on one more engine (graphs on): warmed with one run
of each, the next runs go under ``Engine.start_profile`` (for
``Workload.latency_profile_steps`` and ``Workload.profile_steps`` scheduler
steps), and radixserve.bench.profile reads from each trace the median wall time
of a decode step at that batch size and the fraction of it the device is busy.

Request sets, metrics and the offline driver are radixserve.bench's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from radixserve import Engine
from radixserve.bench import datasets
from radixserve.bench.datasets import BenchRequest, TokenSource
from radixserve.bench.driver import Arrivals
from radixserve.bench.metrics import summarize
from radixserve.bench.offline import run_offline
from radixserve.bench.profile import DecodeProfile, decode_profile
from radixserve.testing.tiny_models import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    llama3_rope_scaling,
    tiny_config,
)


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_original_context: int


@dataclass(frozen=True)
class Workload:
    latency_prompt: int = 128
    latency_output: int = 256
    latency_runs: int = 3
    batches: tuple[int, ...] = (64, 256)
    ragged_min: int = 128
    ragged_max: int = 512
    ragged_output: int = 256
    gsp_groups: int = 8
    gsp_per_group: int = 16
    gsp_system: int = 1024
    gsp_question: int = 64
    gsp_output: int = 32
    context_length: int = 2048
    # --profile: scheduler steps profiled (the prefills of the first batch, then its decode steps),
    # and of the latency run (its first request's prefill and decode steps).
    profile_steps: int = 96
    latency_profile_steps: int = 60

    @property
    def max_running(self) -> int:
        return max(max(self.batches), self.gsp_groups * self.gsp_per_group)


SHAPES = {
    "8b": Shape(4096, 32, 32, 8, 14336, 128256, 131072, 8192),  # Llama-3.1-8B
    "tiny": Shape(64, 2, 4, 2, 128, 512, 1024, 64),
}
WORKLOADS = {
    "8b": Workload(),
    "tiny": Workload(
        latency_prompt=16,
        latency_output=8,
        latency_runs=2,
        batches=(4, 8),
        ragged_min=8,
        ragged_max=32,
        ragged_output=8,
        gsp_groups=2,
        gsp_per_group=4,
        gsp_system=64,
        gsp_question=8,
        gsp_output=4,
        context_length=256,
    ),
}
WEIGHT_STD = 0.02  # transformers' initializer_range: activations stay finite through 32 bf16 layers
SHARD_BYTES = 2 * 2**30


# ---------------------------------------------------------------------------
# The model: random weights drawn on the device, saved shard by shard


def build_model(out_dir: Path, shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write config, safetensors shards (+ index) and tokenizer for a random Llama of ``shape``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = tiny_config(
        "llama",
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.max_position_embeddings,
        rope_scaling=llama3_rope_scaling(original_max_position_embeddings=shape.rope_original_context),
    )
    config.architectures = ["LlamaForCausalLM"]
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    with torch.device("meta"):  # names and shapes only, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    shards = _plan_shards(
        sorted((name, tuple(p.shape)) for name, p in skeleton.named_parameters()),
        torch.empty((), dtype=dtype).element_size(),
    )

    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, dims in shard:
            if "norm" in name:
                tensor = torch.ones(dims, dtype=dtype, device=device)
            else:
                tensor = torch.randn(dims, generator=gen, dtype=dtype, device=device).mul_(WEIGHT_STD)
            tensors[name] = tensor.cpu()
            weight_map[name] = file
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    build_word_tokenizer(out_dir, shape.vocab_size)
    return out_dir


def _plan_shards(params: list[tuple[str, tuple[int, ...]]], element_size: int) -> list[list]:
    """Consecutive groups of parameters of about SHARD_BYTES each."""
    shards, size = [[]], 0
    for name, dims in params:
        nbytes = element_size * torch.Size(dims).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    return shards


def build_word_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer of exactly ``vocab_size`` tokens, made instantly
    (training BPE on 128k tokens would take minutes): the special tokens of the
    test models first (so the config's bos/eos/pad ids match), then ``w5``, ``w6``, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 20,
    )
    fast.save_pretrained(str(out_dir))


# ---------------------------------------------------------------------------
# Measurements through the Engine


@dataclass
class Result:
    """One row of the table: a value per column (``graphs``, ``eager``), None where not run."""

    name: str
    unit: str
    graphs: float | None = None
    eager: float | None = None
    note: str = ""


class EngineRuns:
    """One Engine configuration and the workloads run on it."""

    def __init__(
        self, model_dir: Path, device: str, dtype: str, workload: Workload, attention_backend: str, **engine_args: Any
    ):
        self.workload = workload
        self.engine = Engine(
            model_path=str(model_dir),
            device=device,
            dtype=dtype,
            page_size=16,
            context_length=workload.context_length,
            max_running_requests=workload.max_running,
            attention_backend=attention_backend,
            log_level="warning",
            **engine_args,
        )
        self.source = TokenSource(self.engine.tokenizer)
        self._warmup = datasets.warmup_requests(self.source, 2, seed=0)

    def run(self, requests: list[BenchRequest], arrivals: Arrivals | None = None) -> dict:
        arrivals = arrivals or Arrivals()
        results, duration, peak = run_offline(self.engine, requests, self._warmup, arrivals, ignore_eos=True)
        self._warmup = []  # once per engine
        summary = summarize(results, duration, peak)
        if summary["failed"]:
            raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
        return summary

    def latency_ms_per_token(self) -> float:
        w = self.workload
        requests = datasets.random_requests(
            self.source, w.latency_runs, w.latency_prompt, w.latency_output, 1.0, seed=1
        )
        summary = self.run(requests, Arrivals(max_concurrency=1))
        return summary["e2e_latency_ms"]["median"] / w.latency_output

    def throughput(self, batch: int) -> float:
        w = self.workload
        requests = datasets.random_requests(
            self.source, batch, w.ragged_max, w.ragged_output, w.ragged_min / w.ragged_max, seed=2
        )
        requests = [replace(r, output_len=w.ragged_output) for r in requests]  # ragged prompts, fixed outputs
        return self.run(requests)["output_throughput"]

    def shared_prefix(self) -> tuple[float, float | None]:
        w = self.workload
        requests = datasets.shared_prefix_requests(
            self.source, w.gsp_groups, w.gsp_per_group, w.gsp_system, w.gsp_question, w.gsp_output, seed=3
        )
        summary = self.run(requests)
        return summary["output_throughput"], summary["cache_hit_rate"]

    def close(self) -> dict:
        """Stop the engine; its server info (device, backends, graphs)."""
        try:
            return self.engine.server_info()
        finally:
            self.engine.shutdown()


def measure_engine(
    model_dir: Path,
    device: str,
    dtype: str,
    workload: Workload,
    attention_backend: str,
    progress: Callable[[str], None],
) -> tuple[list[Result], dict]:
    """The Engine rows of the table, and each engine's server info by column."""
    w = workload
    latency = Result(f"batch 1, {w.latency_prompt}-token prompt -> {w.latency_output}", "ms/token")
    batches = [
        Result(f"batch {b}, prompts {w.ragged_min}-{w.ragged_max} -> {w.ragged_output}", "output tok/s")
        for b in w.batches
    ]
    shared = f"shared prefix {w.gsp_groups}x{w.gsp_per_group} ({w.gsp_system} + {w.gsp_question} -> {w.gsp_output})"
    radix_on, radix_off = Result(f"{shared}, radix on", "output tok/s"), Result(f"{shared}, radix off", "output tok/s")
    infos: dict[str, dict] = {}

    def engine(label: str, **extra: Any) -> EngineRuns:
        progress(f"engine ({label}): starting")
        return EngineRuns(model_dir, device, dtype, w, attention_backend, **extra)

    def latency_and_throughput(column: str, runs: EngineRuns) -> None:
        progress(f"engine ({column}): batch-1 latency")
        setattr(latency, column, runs.latency_ms_per_token())
        progress(f"engine ({column}): batch-1 latency {getattr(latency, column):.2f} ms/token")
        for row, b in zip(batches, w.batches, strict=False):
            progress(f"engine ({column}): throughput at batch {b}")
            setattr(row, column, runs.throughput(b))
            progress(f"engine ({column}): batch {b}: {getattr(row, column):,.0f} output tok/s")

    runs = engine("graphs")
    try:
        latency_and_throughput("graphs", runs)
        progress("engine (graphs): shared prefix, radix on")
        radix_on.graphs, hit = runs.shared_prefix()
        progress(f"engine (graphs): shared prefix, radix on: {radix_on.graphs:,.0f} output tok/s")
        radix_on.note = f"cache hit rate {hit:.0%}" if hit is not None else ""
    finally:
        infos["graphs"] = runs.close()
    if captured_graphs(infos["graphs"]):
        runs = engine("eager", disable_graph=True)
        try:
            latency_and_throughput("eager", runs)
        finally:
            infos["eager"] = runs.close()
    else:  # the graphs engine ran eagerly already
        latency.note = f"graphs off ({(infos['graphs'].get('graphs') or {}).get('reason')}): one engine, eager"
    runs = engine("graphs, radix off", disable_radix_cache=True)
    try:
        progress("engine (graphs, radix off): shared prefix")
        radix_off.graphs, _ = runs.shared_prefix()
        progress(f"engine (graphs, radix off): shared prefix: {radix_off.graphs:,.0f} output tok/s")
    finally:
        infos["radix_off"] = runs.close()
    ratio = Result("radix on / off", "x", graphs=radix_on.graphs / radix_off.graphs)
    return [latency, *batches, radix_on, radix_off, ratio], infos


def profile_decode(
    model_dir: Path,
    device: str,
    dtype: str,
    workload: Workload,
    attention_backend: str,
    progress: Callable[[str], None],
) -> list[tuple[int, DecodeProfile | None, str]]:
    """Profile, on one warm engine, the batch-1 latency run and the first
    throughput batch: for each, the decode steps at that batch size (None if the
    trace has fewer than two) and the trace's path."""
    batch = workload.batches[0]
    progress(f"engine (profile): starting; warm-up runs at batch 1 and {batch}")
    runs = EngineRuns(model_dir, device, dtype, workload, attention_backend)
    profiles = []
    try:
        runs.latency_ms_per_token()
        runs.throughput(batch)
        for size, run, steps in (
            (1, runs.latency_ms_per_token, workload.latency_profile_steps),
            (batch, lambda: runs.throughput(batch), workload.profile_steps),
        ):
            progress(f"engine (profile): profiling {steps} steps at batch {size}")
            runs.engine.start_profile(num_steps=steps)
            run()
            path = runs.engine.stop_profile()  # the trace, written when the steps ran out or now
            profiles.append((size, decode_profile(json.loads(Path(path).read_text()), size), path))
    finally:
        runs.close()
    return profiles


def format_profile(batch: int, prof: DecodeProfile | None, path: str) -> str:
    if prof is None:
        return f"profile: fewer than two decode steps at batch {batch} in {path}"
    busy = (
        "n/a (no device activity in the trace)"
        if prof.device_busy_fraction is None
        else f"{prof.device_busy_fraction:.1%}"
    )
    return (
        f"profile, decode at batch {batch} ({prof.steps} steps): {prof.step_ms_median:.2f} ms per step "
        f"(host launch {prof.host_ms_median:.2f} ms), device busy {busy}; trace {path}"
    )


def captured_graphs(info: dict) -> list[int]:
    """The decode batch sizes an engine replays from graphs (none: it ran eagerly)."""
    return (info.get("graphs") or {}).get("batch_sizes") or []


# ---------------------------------------------------------------------------
# The HF baseline


def hf_latency_ms_per_token(model_dir: Path, device: torch.device, dtype: torch.dtype, workload: Workload) -> float:
    """Batch-1 ``generate`` with a static KV cache (transformers compiles the forward
    on cuda); best of two timed runs after one warm-up of the same lengths."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    vocab = model.config.vocab_size
    prompt = torch.randint(
        len(SPECIAL_TOKENS), vocab, (1, workload.latency_prompt), generator=torch.Generator().manual_seed(4)
    ).to(device)
    n = workload.latency_output
    kwargs = dict(
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=model.config.pad_token_id,
    )
    best = float("inf")
    with torch.inference_mode():
        for attempt in range(3):
            _sync(device)
            start = time.perf_counter()
            out = model.generate(prompt, **kwargs)
            _sync(device)
            if attempt:  # the first run compiles
                best = min(best, time.perf_counter() - start)
            assert out.shape[1] == prompt.shape[1] + n
    del model
    return 1000 * best / n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------
# Report


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"


def format_table(rows: list[Result]) -> str:
    header = ("measurement", "unit", "graphs", "eager", "note")
    body = [(r.name, r.unit, _fmt(r.graphs), _fmt(r.eager), r.note) for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: tuple[str, ...]) -> str:  # numbers right-aligned, text left
        cells = [c.rjust(w) if i in (2, 3) else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=False))]
        return "| " + " | ".join(cells) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(header), sep, *map(fmt, body)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda", help="a radixserve platform: cuda, or cpu for the smoke run")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 elsewhere")
    parser.add_argument("--attention-backend", default="auto", help="e.g. flashinfer or triton (default: auto)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the HF generate baseline")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile the decode steps of the batch-1 latency run and of the first throughput "
        "batch: step time and device-busy fraction (the traces go to $RADIXSERVE_PROFILE_DIR, "
        "else new temporary directories)",
    )
    args = parser.parse_args(argv)

    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    device = torch.device(args.device)
    shape, workload = SHAPES[args.shape], WORKLOADS[args.shape]
    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="radixserve-bench-gpu-") as tmp:
        progress(f"building the {args.shape} model ({dtype_name}) on {device}")
        model_dir = build_model(Path(tmp) / "model", shape, device, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the Engine's scheduler process sizes its KV pool from free memory
        progress("model written")
        rows, infos = measure_engine(model_dir, args.device, dtype_name, workload, args.attention_backend, progress)
        profiles = []
        if args.profile:  # before HF, whose memory this process's allocator may keep
            profiles = profile_decode(model_dir, args.device, dtype_name, workload, args.attention_backend, progress)
            for size, prof, trace_path in profiles:
                progress(format_profile(size, prof, trace_path))
        if not args.skip_hf:
            progress("HF generate (static cache) batch-1 latency")
            hf = hf_latency_ms_per_token(model_dir, device, dtype, workload)
            rows.append(
                Result(
                    f"HF generate, batch 1, {workload.latency_prompt} -> {workload.latency_output}, static cache",
                    "ms/token",
                    graphs=hf,
                    note="transformers compiles the forward on cuda" if device.type == "cuda" else "",
                )
            )
    info = infos["graphs"]
    sizes = captured_graphs(info)
    graphs = f"graphs for {len(sizes)} batch sizes up to {max(sizes)}" if sizes else "no graphs"
    header = (
        f"bench_gpu {args.shape} ({dtype_name}) on {info.get('device', args.device)}: "
        f"backends {info.get('backends')}, {graphs}, torch {torch.__version__}, "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(header)
    print(format_table(rows))
    for size, prof, trace_path in profiles:
        print(format_profile(size, prof, trace_path))
    if args.json:
        report = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "shape": args.shape,
            "shape_config": asdict(shape),
            "workload": asdict(workload),
            "dtype": dtype_name,
            "device": info.get("device"),
            "backends": info.get("backends"),
            "graphs": info.get("graphs"),
            "machine": {"platform": platform.platform(), "torch": torch.__version__},
            "rows": [asdict(r) for r in rows],
        }
        for size, prof, trace_path in profiles:
            report[f"decode_bs{size}"] = None if prof is None else {**asdict(prof), "trace": trace_path}
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
