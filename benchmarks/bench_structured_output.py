"""What structured output costs (issue 25): compile times of the grammar backends, and the
per-token cost of constrained decoding against unconstrained at batch 32.

1. Compile times, in this process, through the scheduler's own ``GrammarCompiler`` (the
   backend built on first use, a cache of compiled grammars): for each backend, the first
   compile of a 20-tool call schema (``anyOf`` over 20 functions with typed parameters) and
   of a large schema (``--large-properties`` nested properties), then the same spec again
   (the cache), then a spec of the same size the backend has not seen (a warm backend).
2. Decode cost, through a real server: ``--batch`` streams at once, each ``--output-len``
   tokens with ``ignore_eos``, with no constraint and under each of :data:`GRAMMARS`
   (printable ASCII that never ends, so every round generates the same number of tokens);
   the median of ``--repeats`` alternating rounds of each. The cost is a constrained
   round's time over the unconstrained one's, minus 1.
3. The grammar's parts, in this process (ms per step for ``--batch`` rows): the backend's
   fill of the bitmask and its advance by one token (``accept_token``) under each grammar,
   and the bitmask's application to the logits (random words: none of them all ones, which
   the kernels skip) by the torch code of ``ElementwiseBackend.apply_token_bitmask``, by
   ``cpu_fused``'s C++ kernel (what the sampler runs on a CPU that builds it) and by
   xgrammar's own CPU kernel, at the model's vocabulary and at 151,936 tokens (Qwen's, for
   scale).

    python benchmarks/bench_structured_output.py --model ~/.cache/radixserve-bench/models/llama
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from radixserve.checkpoints.loader import eos_token_ids
from radixserve.registry import PluginRegistry
from radixserve.structured_output.backend import GrammarSpec, GrammarTokenizer
from radixserve.structured_output.grammar_compiler import GrammarCompiler
from radixserve.structured_output.grammar_queue import tokenizer_loader

# Printable ASCII without end: the grammar never lets a request stop early (with ignore_eos,
# an EOS the grammar accepts would still end it). The free-text part of a JSON string or a
# tool call's argument, as a grammar that cannot close. The counted regex is the same
# constraint as xgrammar turns it into a repetition of 2,048 items: it shows what a large
# bounded repetition costs there (the per-token advance, not the mask).
GRAMMARS = {"ascii, no end (ebnf)": ("ebnf", "root ::= [ -~] root"), "ascii{2048,} (regex)": ("regex", r"[ -~]{2048,}")}


def tool_schema(n_tools: int, salt: str = "") -> dict[str, Any]:
    def tool(i: int) -> dict[str, Any]:
        params = {
            f"arg{j}{salt}": {"type": ["string", "integer", "number", "boolean"][j % 4]} for j in range(1 + i % 5)
        }
        params["mode"] = {"enum": ["fast", "slow", f"m{i}"]}
        arguments = {"type": "object", "properties": params, "required": sorted(params)}
        return {
            "type": "object",
            "properties": {"name": {"const": f"tool_{i}{salt}"}, "arguments": arguments},
            "required": ["name", "arguments"],
        }

    return {"anyOf": [tool(i) for i in range(n_tools)]}


def large_schema(n_properties: int, salt: str = "") -> dict[str, Any]:
    leaf = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
    }
    props = {
        f"field{i}{salt}": leaf if i % 3 == 0 else {"type": "string", "pattern": "[a-z]{1,8}"}
        for i in range(n_properties)
    }
    return {"type": "object", "properties": props, "required": sorted(props)[: n_properties // 2]}


def _loader(model: str) -> Callable[[], GrammarTokenizer]:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model)
    eos = eos_token_ids(model, config, AutoTokenizer.from_pretrained(model))
    return tokenizer_loader(model, config.vocab_size, eos)


def compile_times(model: str, backend_name: str, large_properties: int) -> dict[str, float]:
    compiler = GrammarCompiler(PluginRegistry().grammar_backend(backend_name), _loader(model))
    out: dict[str, float] = {}

    def timed(label: str, schema: dict[str, Any]) -> None:
        start = time.perf_counter()
        compiler.submit(GrammarSpec("json_schema", json.dumps(schema))).result()
        out[label] = round((time.perf_counter() - start) * 1000, 2)

    timed("backend build + first 20-tool schema (ms)", tool_schema(20))
    timed("20-tool schema again, cached (ms)", tool_schema(20))
    timed("another 20-tool schema, warm backend (ms)", tool_schema(20, salt="b"))
    timed(f"large schema, {large_properties} properties (ms)", large_schema(large_properties))
    timed("large schema again, cached (ms)", large_schema(large_properties))
    timed("another large schema, warm backend (ms)", large_schema(large_properties, salt="b"))
    return out


async def one_round(url: str, batch: int, output_len: int, grammar: tuple[str, str] | None) -> float:
    body: dict[str, Any] = {"model": "bench", "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
    if grammar is not None:
        field, text = grammar  # SGLang's completion fields: regex, ebnf
        body[field] = text
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i: int) -> int:
            r = await client.post(url + "/v1/completions", json={**body, "prompt": f"request {i}: tell a story"})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(batch)))
        elapsed = time.perf_counter() - start
    assert all(t == output_len for t in tokens), tokens
    return elapsed


def decode_cost(model: str, backend_name: str, batch: int, output_len: int, repeats: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--model", model, "--served-model-name", "bench"]
    cmd += ["--port", "0", "--log-level", "warning", "--grammar-backend", backend_name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            if "radixserve ready at" in line:
                url = line.split("ready at", 1)[1].split()[0]
                break
        if url is None:
            raise RuntimeError("the server did not start")
        for grammar in GRAMMARS.values():  # warm: compile and first steps
            asyncio.run(one_round(url, batch, 8, grammar))
        rounds: dict[str, list[float]] = {"unconstrained": [], **{name: [] for name in GRAMMARS}}
        for _ in range(repeats):
            rounds["unconstrained"].append(asyncio.run(one_round(url, batch, output_len, None)))
            for name, grammar in GRAMMARS.items():
                rounds[name].append(asyncio.run(one_round(url, batch, output_len, grammar)))
        plain = statistics.median(rounds["unconstrained"])
        out: dict[str, Any] = {"unconstrained s": round(plain, 3)}
        for name in GRAMMARS:
            constrained = statistics.median(rounds[name])
            out[f"{name} s"] = round(constrained, 3)
            out[f"{name} per-token cost"] = f"{(constrained / plain - 1) * 100:+.1f}%"
        return {**out, "rounds": rounds}
    finally:
        proc.terminate()
        proc.wait(60)


def _ms(fn: Any, repeats: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return round((time.perf_counter() - start) / repeats * 1000, 3)


def mask_costs(model: str, backend_name: str, batch: int) -> dict[str, float]:
    import torch

    from radixserve.kernels import KernelQuery
    from radixserve.kernels.elementwise import apply_token_bitmask
    from radixserve.structured_output.backend import allocate_token_bitmask

    out: dict[str, float] = {}
    load = _loader(model)
    backend = PluginRegistry().grammar_backend(backend_name)(load())
    vocab = load().vocab_size
    bitmask = allocate_token_bitmask(batch, vocab)
    tokenizer = load().tokenizer
    added = set(tokenizer.get_added_vocab().values())  # special tokens decode to printable text too
    printable = [
        t
        for t in range(len(tokenizer))
        if t not in added and (s := tokenizer.decode([t])) and all(" " <= c <= "~" for c in s)
    ]
    for name, (kind, text) in GRAMMARS.items():
        compiled = backend.compile(GrammarSpec(kind, text))
        matchers = [compiled.matcher() for _ in range(batch)]
        step = iter(range(10**9))

        def fill_and_advance() -> None:
            """One decode step's grammar work: each row's mask, then its matcher advanced
            by a printable token (each row and step another one, as sampling gives)."""
            k = next(step)
            for i, m in enumerate(matchers):
                m.fill_bitmask(bitmask, i)
                assert m.accept_token(printable[(k * batch + i) * 7919 % len(printable)])

        out[f"{name}: fill and advance {batch} rows"] = _ms(fill_and_advance)
    rows = torch.arange(batch)
    query = KernelQuery(device="cpu", dtype=torch.float32)
    appliers = {
        "torch code": apply_token_bitmask,
        "cpu_fused": PluginRegistry().select("elementwise", query, "cpu_fused")(query).apply_token_bitmask,
    }
    for width in (vocab, 151936):
        mask = torch.randint(-(2**31), 2**31 - 1, (batch, (width + 31) // 32), dtype=torch.int32)
        mask[mask == -1] = 0
        logits = torch.randn(batch, width)
        for name, apply in appliers.items():
            out[f"apply, {name}, vocab {width}"] = _ms(lambda: apply(logits, mask, rows))
        if backend_name == "xgrammar":
            import xgrammar

            indices = list(range(batch))
            out[f"apply, xgrammar C++, vocab {width}"] = _ms(
                lambda: xgrammar.apply_token_bitmask_inplace(logits, mask, indices=indices)
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    p.add_argument("--large-properties", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-decode", action="store_true", help="compile times and mask parts only (no server)")
    ns = p.parse_args(argv)
    results = {}
    for name in ns.backends:
        results[name] = {"compile": compile_times(ns.model, name, ns.large_properties)}
        results[name]["mask (ms)"] = mask_costs(ns.model, name, ns.batch)
        if not ns.skip_decode:
            results[name]["decode"] = decode_cost(ns.model, name, ns.batch, ns.output_len, ns.repeats)
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
