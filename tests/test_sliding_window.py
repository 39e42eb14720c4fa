"""Sliding-window attention end to end: a tiny Mistral whose window (16 keys) is
shorter than prompt + output generates exactly HF's greedy tokens (float32) with
the radix cache on (a second request reuses a cached prefix longer than the
window) and chunked prefill (chunks shorter than the window): on the CPU
backends ``auto`` picks, on ``torch_native`` under decode graphs (the
replay-in-eager stand-in), and on ``triton`` under graphs in the Triton
interpreter (a subprocess: TRITON_INTERPRET is read when the kernels are
defined). The attention kernels themselves are checked by the conformance kit."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import torch
from generation_utils import hf_greedy, make_scheduler, mixed_prompts, run, run_in_triton_interpreter, submit

from radixserve.hooks import hookimpl
from radixserve.registry import PluginRegistry
from radixserve.testing.graphs import EagerReplayGraphBackend
from radixserve_torch.platform import CpuPlatform

WINDOW = 16
NEW_TOKENS = 64
SHARED = 28  # the second prompt's first tokens are the first prompt's: a cached prefix past the window
# Pages of 4 (the shared prefix is whole pages) and prefill chunks of 8 (shorter than the window).
SERVING = dict(page_size=4, chunked_prefill_size=8)


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_factory) -> Path:
    return tiny_model_factory(arch="mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    first, tail, other = mixed_prompts(512, [34, 12, 20], seed=21)
    return [first, first[:SHARED] + tail, other]


@pytest.fixture(scope="module")
def hf_tokens(mistral_dir, prompts) -> list[list[int]]:
    return [hf_greedy(mistral_dir, p, NEW_TOKENS)[0] for p in prompts]


def generate_in_turn(scheduler, prompts: list[list[int]], new_tokens: int) -> list:
    """The first prompt alone (its pages then sit in the radix cache), then the rest together."""
    params = dict(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    first = submit(scheduler, prompts[0], **params)
    results = run(scheduler)
    rids = [submit(scheduler, p, **params) for p in prompts[1:]]
    results.update(run(scheduler))
    return [results[rid] for rid in [first, *rids]]


def test_the_window_is_on_every_layer_and_changes_the_tokens(mistral_dir, tiny_model_factory, prompts, hf_tokens):
    scheduler = make_scheduler(mistral_dir, attention_backend="torch_native")
    layers = [layer.self_attn.attn.spec for layer in scheduler.runner.model.model.layers]
    assert [spec.sliding_window for spec in layers] == [WINDOW] * len(layers)
    assert scheduler.runner.query.sliding_window == WINDOW
    assert scheduler.runner.model.max_context_len == 1024  # a window, not a context cap
    # The same weights without a window (Mistral's default 4096 covers the whole context) differ.
    unwindowed = tiny_model_factory(arch="mistral")
    assert hf_greedy(unwindowed, prompts[1], NEW_TOKENS)[0] != hf_tokens[1]


def test_auto_backends_generate_hf_tokens(mistral_dir, prompts, hf_tokens):
    scheduler = make_scheduler(mistral_dir, **SERVING)
    results = generate_in_turn(scheduler, prompts, NEW_TOKENS)
    assert scheduler.runner.summary()["backends"]["attention"] in ("cpu_paged", "torch_varlen")
    assert [r.output_ids for r in results] == hf_tokens
    assert results[1].cached_tokens == SHARED > WINDOW  # pages wholly outside the window, reused


class CpuGraphsPlatform(CpuPlatform):
    """The cpu platform, offering the replay-in-eager stand-in for graphs."""

    name = "cpu_graphs"
    priority = -1

    def graph_backend(self, device: torch.device) -> EagerReplayGraphBackend:
        return EagerReplayGraphBackend()


class GraphsPlugin:
    @hookimpl
    def register_platforms(self, register):
        register(CpuGraphsPlatform)


def test_torch_native_decode_graphs_generate_hf_tokens(mistral_dir, prompts, hf_tokens):
    registry = PluginRegistry()
    registry.register_plugin(GraphsPlugin(), "test-graphs")
    scheduler = make_scheduler(
        mistral_dir,
        registry=registry,
        device="cpu_graphs",
        attention_backend="torch_native",
        graph_max_bs=4,
        disable_graph=False,
        **SERVING,
    )
    results = generate_in_turn(scheduler, prompts, NEW_TOKENS)
    assert [r.output_ids for r in results] == hf_tokens
    replays = scheduler.runner.graph_runner.backend.replays
    assert replays.count(1) >= NEW_TOKENS - 1 and 2 in replays  # every decode step replayed


# Triton in the interpreter: the first two prompts (6 new tokens each: both are past the
# window already, and every interpreted step costs a launch per kernel per layer), extend
# eagerly, decode through the graphs of the stand-in offered by the cpu platform
# itself (triton runs on a platform named "cpu" only). One JSON line out.
TRITON_RUN = textwrap.dedent("""
    import json, sys
    from generation_utils import make_scheduler
    from test_sliding_window import SERVING, generate_in_turn
    from radixserve.testing.graphs import EagerReplayGraphBackend
    from radixserve_torch.platform import CpuPlatform

    CpuPlatform.graph_backend = lambda self, device: EagerReplayGraphBackend()
    scheduler = make_scheduler(sys.argv[1], attention_backend="triton", context_length=256, graph_max_bs=2,
                               disable_graph=False, **SERVING)
    results = generate_in_turn(scheduler, json.loads(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps({"tokens": [r.output_ids for r in results], "cached": [r.cached_tokens for r in results],
                      "replays": scheduler.runner.graph_runner.backend.replays,
                      "attention": scheduler.runner.summary()["backends"]["attention"]}))
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_in_the_interpreter_generates_hf_tokens(mistral_dir, prompts, hf_tokens):
    new_tokens = 6  # greedy: HF's first 6 tokens of its 64
    out = run_in_triton_interpreter(TRITON_RUN, str(mistral_dir), json.dumps(prompts[:2]), str(new_tokens))
    assert out["attention"] == "triton"
    assert out["tokens"] == [tokens[:new_tokens] for tokens in hf_tokens[:2]]
    assert out["cached"][1] == SHARED
    assert out["replays"].count(1) >= 2 * (new_tokens - 1)  # both requests' decode steps replayed
