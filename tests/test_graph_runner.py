"""Decode graphs (runtime/execution/graph_runner.py) on a CPU, through a stand-in graph
backend that replays by rerunning the captured callable eagerly
(radixserve.testing.graphs): the batch-size table and padding, the static
buffers, the attention backends' capture/replay hooks, and greedy tokens equal
to eager decoding. Real CUDA graphs: the ``cuda``-marked test at the end.

The Triton backend's hooks run in the Triton interpreter, in a subprocess
(``test_triton_graphs_in_interpreter`` re-runs this file there, as
test_triton_backends.py does)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from generation_utils import make_scheduler, mixed_prompts, run, submit
from helpers_platform import needs_platform

from radixserve import Engine
from radixserve.config import ServerArgs
from radixserve.forward_batch import ForwardBatch
from radixserve.hooks import hookimpl
from radixserve.registry import PluginRegistry
from radixserve.runtime.execution.graph_runner import capture_batch_sizes, padded_batch_size
from radixserve.runtime.execution.model_runner import ModelRunner
from radixserve.testing.graphs import EagerReplayGraphBackend
from radixserve_torch.attention import TorchNativeAttention
from radixserve_torch.platform import CpuPlatform

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class CpuGraphsPlatform(CpuPlatform):
    """The cpu platform, offering the replay-in-eager stand-in for graphs."""

    name = "cpu_graphs"
    priority = -1  # never picked by --device auto

    def graph_backend(self, device: torch.device) -> EagerReplayGraphBackend:
        return EagerReplayGraphBackend()


class RecordingNativeAttention(TorchNativeAttention):
    """torch_native, noting what each replay hook and graph decode receives."""

    name = "recording_native"
    replays: list[dict] = []
    graph_decodes: list[tuple[list, list, list]] = []

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        super().init_forward_metadata_replay(batch)
        meta = batch.attn_metadata
        self.replays.append(
            {
                "bs": batch.batch_size,
                "ptrs": [
                    t.data_ptr()
                    for t in (
                        batch.input_ids,
                        batch.positions,
                        batch.out_cache_loc,
                        batch.req_pool_indices,
                        batch.seq_lens,
                        meta.slots,
                        meta.mask,
                    )
                ],
                "host_lists": (list(batch.seq_lens_cpu), list(batch.prefix_lens_cpu), list(batch.extend_lens_cpu)),
                "seq_lens": batch.seq_lens.clone(),
                "out_cache_loc": batch.out_cache_loc.clone(),
                "req_pool_indices": batch.req_pool_indices.clone(),
                "slots": meta.slots.clone(),
                "mask": meta.mask.clone(),
                "expected_slots": batch.req_to_token.index_select(0, batch.req_pool_indices),
            }
        )

    def forward_decode(self, q, layer, batch):
        if batch.attn_metadata is not None:  # a captured (or replayed) decode
            self.graph_decodes.append((batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu))
        return super().forward_decode(q, layer, batch)


class GraphsPlugin:
    @hookimpl
    def register_platforms(self, register):
        register(CpuGraphsPlatform)

    @hookimpl
    def register_attention_backends(self, register):
        register(RecordingNativeAttention)


@pytest.fixture
def registry():
    registry = PluginRegistry()
    registry.register_plugin(GraphsPlugin(), "test-graphs")
    return registry


# Seven requests finishing one decode step apart: decode batches of 7, 6, ..., 1.
PROMPT_LENS = [5, 17, 9, 30, 3, 12, 21]
MAX_NEW = [2, 3, 4, 5, 6, 7, 8]


def _generate(scheduler, count: int = len(PROMPT_LENS)) -> list[list[int]]:
    """The first ``count`` requests: decode batches of ``count``, ``count - 1``, ..., 1."""
    prompts = mixed_prompts(512, PROMPT_LENS[:count], seed=71)
    rids = [
        submit(scheduler, p, max_new_tokens=n, temperature=0.0, ignore_eos=True)
        for p, n in zip(prompts, MAX_NEW[:count], strict=False)
    ]
    results = run(scheduler)
    return [results[r].output_ids for r in rids]


# --------------------------------------------------------------------------
# The batch-size table


def test_capture_batch_sizes_and_padding():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert capture_batch_sizes(300)[-5:] == [248, 256, 272, 288, 300]
    sizes = capture_batch_sizes(20)
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20, 21)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        20,
        20,
        None,
    ]
    with pytest.raises(ValueError, match="graph_max_bs"):
        capture_batch_sizes(0)


def test_flags_and_sglang_aliases():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    sglang = ServerArgs.from_cli_args(parser.parse_args(["--cuda-graph-max-bs", "16", "--disable-cuda-graph"]))
    assert (sglang.graph_max_bs, sglang.disable_graph) == (16, True)
    neutral = ServerArgs.from_cli_args(parser.parse_args(["--graph-max-bs", "8", "--disable-graph"]))
    assert (neutral.graph_max_bs, neutral.disable_graph) == (8, True)
    default = ServerArgs.from_cli_args(parser.parse_args([]))
    assert (default.graph_max_bs, default.disable_graph) == (None, None)
    with pytest.raises(ValueError, match="graph_max_bs: must be >= 1"):
        ServerArgs(graph_max_bs=0)


# --------------------------------------------------------------------------
# Whether graphs run, and why not


def _runner(model_dir, registry, **kw) -> ModelRunner:
    args = ServerArgs(model_path=str(model_dir), max_total_tokens=2048, **kw)
    return ModelRunner(args, str(model_dir), registry)


def test_graphs_off_with_a_reason_or_an_error_when_forced(tiny_llama_dir, registry):
    cpu = _runner(tiny_llama_dir, registry, device="cpu", attention_backend="torch_native")
    assert cpu.graph_runner is None
    assert cpu.summary()["graphs"] == {"backend": None, "reason": "platform 'cpu' has no graph capture"}
    with pytest.raises(ValueError, match="disable_graph: graphs were asked for, but platform 'cpu' has no graph"):
        _runner(tiny_llama_dir, registry, device="cpu", attention_backend="torch_native", disable_graph=False)
    # A backend without the hooks: graphs off, naming it; forced on: an error naming it.
    varlen = _runner(tiny_llama_dir, registry, device="cpu_graphs", attention_backend="torch_varlen")
    assert varlen.graph_runner is None and "'torch_varlen' has no graph capture hooks" in varlen.graphs["reason"]
    with pytest.raises(ValueError, match="'torch_varlen' has no graph capture hooks"):
        _runner(tiny_llama_dir, registry, device="cpu_graphs", attention_backend="torch_varlen", disable_graph=False)
    off = _runner(tiny_llama_dir, registry, device="cpu_graphs", attention_backend="torch_native", disable_graph=True)
    assert off.graph_runner is None and off.graphs["reason"] == "--disable-graph"
    # torch_native reads whole slot-table rows under graphs: only for small batch x context.
    reasons = TorchNativeAttention(cpu.query).graph_unsupported_reasons(128, 32768)
    assert len(reasons) == 1 and "lower --graph-max-bs or --context-length" in reasons[0]


def test_graphs_off_for_a_moe_backend_that_routes_on_the_host(tiny_model_factory, registry):
    """torch_native MoE picks its experts with ``.tolist()``: capturing it failed on
    an H100 ("operation failed due to a previous error during capture")."""
    moe_dir = tiny_model_factory(arch="qwen3_moe")
    runner = _runner(
        moe_dir, registry, device="cpu_graphs", attention_backend="torch_native", moe_backend="torch_native"
    )
    assert runner.graph_runner is None
    assert (
        runner.graphs["reason"] == "moe backend 'torch_native' loops on the host over the experts that received tokens"
    )
    with pytest.raises(ValueError, match="moe backend 'torch_native' loops on the host"):
        _runner(
            moe_dir,
            registry,
            device="cpu_graphs",
            attention_backend="torch_native",
            moe_backend="torch_native",
            disable_graph=False,
        )


def test_capture_at_startup_every_size_largest_first(tiny_llama_dir, registry):
    runner = _runner(
        tiny_llama_dir,
        registry,
        device="cpu_graphs",
        attention_backend="torch_native",
        max_running_requests=12,
        graph_max_bs=64,
    )
    graphs = runner.summary()["graphs"]
    # Capped at --max-running-requests: no decode batch is larger.
    assert graphs["backend"] == "eager_replay" and graphs["batch_sizes"] == [1, 2, 4, 8, 12]
    assert graphs["capture_seconds"] > 0
    assert runner.graph_runner.backend.captured == [12, 8, 4, 2, 1]


# --------------------------------------------------------------------------
# Replay: tokens, padding, static buffers, metadata hooks


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_tokens_with_graphs_equal_eager(tiny_llama_dir, registry, overlap):
    eager = _generate(make_scheduler(tiny_llama_dir, attention_backend="torch_native"))
    scheduler = make_scheduler(
        tiny_llama_dir,
        registry=registry,
        device="cpu_graphs",
        attention_backend="torch_native",
        graph_max_bs=4,
        disable_overlap_schedule=not overlap,
    )
    assert _generate(scheduler) == eager
    backend = scheduler.runner.graph_runner.backend
    # Decode batches of 7, 6, 5 ran eagerly (above the largest size, 4); 4, 3 (padded to 4), 2, 1 replayed.
    # With overlap a finished request runs one step too many, so a size may repeat.
    assert set(backend.replays) == {1, 2, 4}
    assert backend.replays.count(4) >= 2 and 3 not in backend.replays
    assert scheduler.check_memory()


def test_replay_reuses_static_buffers_and_refills_metadata_in_place(tiny_llama_dir, registry):
    RecordingNativeAttention.replays.clear()
    RecordingNativeAttention.graph_decodes.clear()
    scheduler = make_scheduler(
        tiny_llama_dir, registry=registry, device="cpu_graphs", attention_backend="recording_native", graph_max_bs=4
    )
    graph_runner = scheduler.runner.graph_runner
    capture_decodes = len(RecordingNativeAttention.graph_decodes)  # layers x sizes at capture
    assert capture_decodes == scheduler.runner.num_layers * len(graph_runner.batch_sizes)
    at_capture = len(RecordingNativeAttention.replays)  # torch_native fills its metadata when captured too
    eager = _generate(make_scheduler(tiny_llama_dir, attention_backend="torch_native"))
    assert _generate(scheduler) == eager

    replays = RecordingNativeAttention.replays[at_capture:]
    assert [r["bs"] for r in replays] == [4, 4, 2, 1]  # real batch sizes 4, 3, 2, 1
    attention = scheduler.runner.attention
    static = [
        graph_runner.input_ids,
        graph_runner.positions,
        graph_runner.out_cache_loc,
        graph_runner.req_pool_indices,
        graph_runner.seq_lens,
        attention._graph_slots,
        attention._graph_mask,
    ]
    for r in replays:
        # Every replay reads the same buffers: those allocated once at start-up.
        assert r["ptrs"] == [t.data_ptr() for t in static]
        # The replay hook gets the host lengths (padding rows: 1), nothing else from the host.
        assert r["host_lists"] == (r["seq_lens"].tolist(), [], [])
        # The metadata was refilled in place for this batch: slot rows and the length mask.
        assert torch.equal(r["slots"], r["expected_slots"])
        lengths = r["mask"].sum(dim=1)
        assert torch.equal(lengths, r["seq_lens"]) and bool(r["mask"][:, 0].all())
    assert all(lists == ([], [], []) for lists in RecordingNativeAttention.graph_decodes)
    assert len(RecordingNativeAttention.graph_decodes) == capture_decodes + scheduler.runner.num_layers * 4

    first, padded = replays[0], replays[1]
    assert bool((first["seq_lens"] > 1).all())  # four real requests, no padding
    # The padded step (3 requests in the graph of 4): its last row is the padding row.
    assert padded["seq_lens"][:3].gt(1).all() and padded["seq_lens"][3].item() == 1
    assert padded["out_cache_loc"][3].item() == 0 and padded["req_pool_indices"][3].item() == 0
    assert padded["out_cache_loc"][:3].ne(0).all()  # real tokens never write the reserved page
    assert padded["mask"][3].sum().item() == 1


# --------------------------------------------------------------------------
# The Triton backend's hooks, in the interpreter


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="this is the launcher; the interpreter run is the test below")
def test_triton_graphs_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interp_triton"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "1 passed" in proc.stdout


@pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter subprocess (test_triton_graphs_in_interpreter)")
def test_interp_triton_graph_tokens_equal_eager(tiny_llama_dir, monkeypatch):
    # Graphs split each request's keys for the longest context: 256 tokens make a few splits (empty ones
    # for padding rows), and keep the interpreter's work small.
    args = dict(device="cpu", attention_backend="triton", context_length=256)
    eager = _generate(make_scheduler(tiny_llama_dir, **args), count=5)
    # Triton runs on a platform named "cpu" only, so here the cpu platform itself offers the stand-in.
    monkeypatch.setattr(CpuPlatform, "graph_backend", CpuGraphsPlatform.graph_backend)
    scheduler = make_scheduler(tiny_llama_dir, graph_max_bs=4, disable_graph=False, **args)
    assert scheduler.runner.graph_runner._graphs[4].batch.attn_metadata.num_kv_splits > 1
    assert _generate(scheduler, count=5) == eager
    assert scheduler.runner.graph_runner.backend.replays == [4, 4, 2, 1]  # batches of 5 (eager), 4, 3, 2, 1


# --------------------------------------------------------------------------
# Real CUDA graphs (skipped without an NVIDIA GPU)


@pytest.mark.cuda
@needs_platform("cuda")
@pytest.mark.parametrize("attention", ["triton", "torch_native"])
def test_cuda_graph_tokens_equal_eager(tiny_llama_dir, attention):
    prompts = mixed_prompts(512, PROMPT_LENS + [40, 7, 25], seed=72)
    outputs = {}
    for disable in (True, False):
        with Engine(
            model_path=str(tiny_llama_dir),
            device="cuda",
            dtype="float32",
            attention_backend=attention,
            max_total_tokens=8192,
            graph_max_bs=8,
            disable_graph=disable,
            log_level="warning",
        ) as engine:
            graphs = engine.server_info()["graphs"]
            assert graphs["backend"] == (None if disable else "cuda_graph"), graphs
            # Ragged batches: requests of different lengths finish at different steps (10 > 8 runs eagerly).
            params = [
                {"max_new_tokens": 4 + 3 * i, "temperature": 0.0, "ignore_eos": True} for i in range(len(prompts))
            ]
            outputs[disable] = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    assert outputs[False] == outputs[True]
