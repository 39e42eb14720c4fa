"""Offline throughput: radixserve Engine vs HuggingFace `generate` on the same
random-weight model, same prompts, greedy, fixed output length.

    python benchmarks/bench_offline.py --dtype float32
    python benchmarks/bench_offline.py --dtype bfloat16

Both run in this process's machine one after the other; the ratio is what to
quote (the machines are noisy).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from radixserve import Engine
from radixserve.testing.tiny_models import build_tiny_model

MODEL = dict(
    hidden_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=2816,
    vocab_size=4096,
    max_position_embeddings=2048,
)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(16, vocab, (n, length), generator=gen).tolist()


def bench_engine(model_dir: Path, batch: list[list[int]], output_len: int, dtype: str) -> tuple[float, list]:
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    with Engine(
        model_path=str(model_dir),
        dtype=dtype,
        max_total_tokens=len(batch) * (len(batch[0]) + output_len) + 1024,
        max_running_requests=len(batch),
        log_level="warning",
    ) as engine:
        engine.generate(input_ids=batch[0][:8], sampling_params={"max_new_tokens": 4})  # warm up
        start = time.perf_counter()
        results = engine.generate(input_ids=batch, sampling_params=params)
        elapsed = time.perf_counter() - start
    assert all(r["meta_info"]["completion_tokens"] == output_len for r in results)
    return elapsed, [r["output_ids"] for r in results]


def bench_hf(model_dir: Path, batch: list[list[int]], output_len: int, dtype: str) -> tuple[float, list]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=model.config.vocab_size + 1, pad_token_id=0
    )
    inputs = torch.tensor(batch)
    with torch.inference_mode():
        model.generate(
            inputs[:1, :8], generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0)
        )
        start = time.perf_counter()
        out = model.generate(inputs, generation_config=config)
        elapsed = time.perf_counter() - start
    return elapsed, out[:, inputs.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", "llama", dtype=args.dtype, **MODEL)
        batch = prompts(args.num_prompts, args.input_len, MODEL["vocab_size"])
        ours, our_ids = bench_engine(model_dir, batch, args.output_len, args.dtype)
        hf, hf_ids = bench_hf(model_dir, batch, args.output_len, args.dtype)

    tokens = args.num_prompts * args.output_len
    agree = sum(a == b for x, y in zip(our_ids, hf_ids, strict=False) for a, b in zip(x, y, strict=False)) / tokens
    print(
        f"date {date.today()}  machine {platform.machine()} {torch.get_num_threads()} threads  "
        f"torch {torch.__version__}"
    )
    print(f"model {MODEL}  dtype {args.dtype}")
    print(f"{args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} new tokens, greedy")
    print(f"radixserve Engine : {ours:7.2f} s  {tokens / ours:8.1f} output tok/s")
    print(f"HF generate       : {hf:7.2f} s  {tokens / hf:8.1f} output tok/s")
    print(f"speedup           : {hf / ours:.2f}x   (greedy token agreement with HF: {agree:.1%})")


if __name__ == "__main__":
    main()
