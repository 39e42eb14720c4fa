"""Quantized checkpoints against bfloat16 on the CPU: one random-weight Llama of about
1B parameters (TinyLlama's shape: hidden 2048, 22 layers, MLP 5632, 32 heads, 4 KV
heads), saved in bfloat16 and quantized to GPTQ, AWQ, compressed-tensors 4-bit (groups of 128),
GPTQ 8-bit, compressed-tensors W8A8 int8 (``CHECKPOINTS``)
and GGUF files (``gguf-q4_0``, ``gguf-q4_k_m``: llama.cpp's Q4_K_M mix of Q4_K and
Q6_K) by radixserve.testing.quantized_checkpoints, each served by the
offline Engine one after the other, in bfloat16 (``--dtype``: ``auto`` serves them as
the platform chooses, float32 on a CPU without bfloat16 dot products):

- batch-1 decode, ms a token: one 128-token prompt, (time to 129 new tokens - time to
  1) / 128, best of ``--repeats`` (the prompt is cached after the first: both times
  are of decode steps and one prefill of a cached prompt);
- ``--streams`` prompts of 128 tokens at once, 128 new tokens each: wall seconds and
  output tokens a second.

    python benchmarks/bench_quantized.py [--streams 16] [--repeats 3] [--formats bf16 gptq awq] [--dtype auto]

The models are built once under ``~/.cache/radixserve-bench/quantized``. The GGUF file is
the one to give llama.cpp's ``llama-bench -m`` for the same model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from radixserve import Engine
from radixserve.testing.quantized_checkpoints import write_gguf, write_quantized
from radixserve.testing.tiny_models import build_tiny_model

SHAPE = dict(
    hidden_size=2048,
    num_layers=22,
    num_heads=32,
    num_kv_heads=4,
    intermediate_size=5632,
    vocab_size=32000,
    max_position_embeddings=2048,
)
ROOT = Path.home() / ".cache" / "radixserve-bench" / "quantized"


# Checkpoint formats by name: write_quantized's arguments (groups of 128 unless said).
CHECKPOINTS = {
    "gptq": dict(method="gptq", bits=4, group=128),
    "awq": dict(method="awq", bits=4, group=128),
    "compressed-tensors": dict(method="compressed-tensors", bits=4, group=128),
    "gptq-int8": dict(method="gptq", bits=8, group=128),
    "w8a8-int8": dict(method="compressed-tensors-w8a8", bits=8, group=-1, sym=True, activations="token"),
}


def model(name: str) -> Path:
    """The model of ``name`` (``bf16``, a key of ``CHECKPOINTS``, or ``gguf-<type>``: a
    GGUF file as llama.cpp's converter writes it, e.g. ``gguf-q4_0``), built on first use."""
    bf16 = ROOT / "bf16"
    if not (bf16 / "config.json").exists():
        build_tiny_model(bf16, "llama", dtype=torch.bfloat16, weight_scale=0.02, **SHAPE)
    if name == "bf16":
        return bf16
    if name.startswith("gguf-"):
        kind = name.removeprefix("gguf-")
        path = ROOT / f"llama-1b-{kind}.gguf"
        if not path.exists():
            write_gguf(bf16, path, kind.upper())
        return path
    path = ROOT / name
    if not (path / "config.json").exists():
        write_quantized(bf16, path, ROOT / f"{name}-dequantized", **CHECKPOINTS[name])
    return path


def prompts(n: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(16, vocab, (n, 128), generator=gen).tolist()


def timed(engine: Engine, ids: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params=params)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--formats", nargs="+", default=["bf16", "gptq", "awq"], help="also: compressed-tensors, gguf-q4_0, gguf-q4_k_m"
    )
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="the Engine's dtype: bfloat16, float32 or auto")
    p.add_argument("--gemm-backend", default="auto", help="the Engine's GEMM backend (auto: chosen by timing)")
    ns = p.parse_args()
    one = prompts(1, SHAPE["vocab_size"])
    many = prompts(ns.streams, SHAPE["vocab_size"])
    for name in ns.formats:
        tokenizer = str(model("bf16")) if name.startswith("gguf-") else None
        path = str(model(name))
        kw = dict(dtype=ns.dtype, gemm_backend=ns.gemm_backend, log_level="warning")
        with Engine(model_path=path, tokenizer_path=tokenizer, **kw) as engine:
            timed(engine, one, 8)  # warm-up
            first = min(timed(engine, one, 1) for _ in range(ns.repeats))
            whole = min(timed(engine, one, 129) for _ in range(ns.repeats))
            wall = timed(engine, many, 128)
            row = {
                "format": name,
                "dtype": ns.dtype,
                "gemm": engine.server_info()["backends"]["gemm"],
                "batch1_decode_ms_per_token": round((whole - first) / 128 * 1000, 1),
                "streams": ns.streams,
                "streams_wall_s": round(wall, 1),
                "streams_out_tok_per_s": round(ns.streams * 128 / wall, 1),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
