"""LongRoPE per request, against HF transformers' ``generate`` on a tiny
random-weight Phi-3 (original context 256, 4096 positions): a sequence within
the original context runs on the short factors, a prompt past it on the long
factors, and a sequence that decodes past it is computed again on the long
factors at that step, as HF's ``generate`` recomputes it (layers/rotary.py).
Greedy tokens and logprobs equal HF's for each, alone and in one ragged batch
(radix cache on and off, chunked prefill); prefixes computed on one set never
serve a request on the other (the prefix cache's namespaces). Unit checks of the
table's two halves, the choice of set and the per-token rotary rows."""

from __future__ import annotations

import pytest
import torch
from generation_utils import generate, hf_greedy, make_scheduler, mixed_prompts
from helpers_models import LOGPROB_TOL, PRIORITY, SCHEDULER_CONFIGS, Reference, check_greedy_matches_hf, hf_reference

from radixserve.cache.memory_pool import ReqToTokenPool
from radixserve.forward_batch import ForwardMode
from radixserve.hooks import hookimpl
from radixserve.kernels import KernelQuery
from radixserve.layers import RotaryEmbedding
from radixserve.layers.context import ModelContext
from radixserve.layers.rotary import LongRope
from radixserve.registry import PluginRegistry, get_registry
from radixserve.runtime.execution.batch import BatchPlan
from radixserve.runtime.execution.request import KVSpan, Req
from radixserve.runtime.scheduling.rope_sets import RopeSets
from radixserve.sampling.params import SamplingParams
from radixserve.testing.graphs import EagerReplayGraphBackend
from radixserve.testing.tiny_models import longrope_scaling, tiny_config
from radixserve.transfer import HostTransfer
from radixserve_torch.platform import CpuPlatform

ORIGINAL, POSITIONS = 256, 4096
SPEC = dict(
    arch="phi3",
    max_position_embeddings=POSITIONS,
    rope_scaling=longrope_scaling(),
    original_max_position_embeddings=ORIGINAL,
)
NEW_TOKENS = 20
# Prompt lengths by the set HF runs them on (with NEW_TOKENS new tokens each).
SHORT = [40, 7]  # within the original context to the end
LONG = [300, 270]  # past it from the prompt on: the long set throughout
CROSSING = [250, 256]  # within it at first; computed again on the long set when the sequence grows past it
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory(**SPEC)


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return hf_reference(model_dir, SHORT + LONG + CROSSING, new_tokens=NEW_TOKENS)


def _part(ref: Reference, lengths: list[int]) -> Reference:
    """The reference's prompts of ``lengths``, in that order (the first also runs alone)."""
    picked = [next(i for i, p in enumerate(ref.prompts) if len(p) == n) for n in lengths]
    return Reference(ref.model_dir, [ref.prompts[i] for i in picked], ref.new_tokens, [ref.hf[i] for i in picked])


@pytest.mark.parametrize("lengths", [SHORT, LONG, CROSSING], ids=["short", "long", "crossing"])
def test_greedy_matches_hf_on_each_set(reference: Reference, lengths: list[int]):
    check_greedy_matches_hf(_part(reference, lengths), "radix-cache")


@pytest.mark.parametrize("config", list(SCHEDULER_CONFIGS))
def test_greedy_matches_hf_with_both_sets_in_one_batch(reference: Reference, config: str):
    """Short, long and crossing requests share extend and decode batches, each token on its own set."""
    check_greedy_matches_hf(_part(reference, CROSSING[:1] + SHORT + LONG + CROSSING[1:]), config)


@pytest.mark.parametrize("long_first", [True, False], ids=["long-then-short", "short-then-long"])
def test_a_prefix_computed_on_one_set_never_serves_the_other(model_dir, long_first: bool):
    """A long and a short prompt share their first 128 tokens: whichever comes
    second finds nothing cached (the other set's KV is in another namespace) and
    still equals HF; a third prompt on the first one's set does reuse the prefix."""
    long, short, long_again, short_again = mixed_prompts(512, [200, 50, 180, 60], seed=5, shared_prefix=128)
    first, second, third = (long, short, long_again) if long_first else (short, long, short_again)
    scheduler = make_scheduler(model_dir, **PRIORITY)
    prompts = (first, second, third)
    results = [
        generate(scheduler, [p], max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprob=True)[0] for p in prompts
    ]
    assert [r.cached_tokens for r in results[1:]] == [0, 128]
    for prompt, result in zip(prompts, results, strict=True):
        ids, logprobs = hf_greedy(model_dir, prompt, NEW_TOKENS)
        assert result.output_ids == ids, f"prompt of {len(prompt)} tokens"
        assert max(abs(a - b) for a, b in zip(result.logprobs, logprobs, strict=True)) < LOGPROB_TOL


class StandInGraphsPlatform(CpuPlatform):
    """The cpu platform with the replay-in-eager stand-in for decode graphs."""

    name = "cpu_graphs_longrope"
    priority = -1  # never picked by --device auto

    def graph_backend(self, device: torch.device) -> EagerReplayGraphBackend:
        return EagerReplayGraphBackend()


class StandInGraphsPlugin:
    @hookimpl
    def register_platforms(self, register):
        register(StandInGraphsPlatform)


def test_decode_graphs_read_each_requests_set(reference: Reference):
    """Decode steps replayed from graphs read the rotary rows from a static buffer
    of their own, refilled at every replay like the positions."""
    registry = PluginRegistry()
    registry.register_plugin(StandInGraphsPlugin(), "test-longrope-graphs")
    part = _part(reference, SHORT + LONG + CROSSING)
    platform = StandInGraphsPlatform.name
    scheduler = make_scheduler(part.model_dir, registry=registry, device=platform, attention_backend="torch_native")
    results = generate(scheduler, part.prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert [r.output_ids for r in results] == [ids for ids, _ in part.hf]
    graphs = scheduler.runner.graph_runner
    assert graphs.rope_rows is not None and graphs.backend.replays


def test_table_holds_hfs_short_set_then_its_long_set():
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = tiny_config("phi3", **{k: v for k, v in SPEC.items() if k != "arch"})
    ctx = ModelContext.create(get_registry(), KernelQuery(device="cpu", dtype=torch.float32), CPU)
    table = RotaryEmbedding(config, 16, ctx).cos_sin_cache
    assert table.shape == (2 * POSITIONS, 16)
    hf = Phi3RotaryEmbedding(config)
    # HF picks the set by the call's last position: within the original context, then past it.
    for first_row, positions in ((0, [0, 1, 100, ORIGINAL - 1]), (POSITIONS, [0, 1, ORIGINAL, POSITIONS - 1])):
        ids = torch.tensor(positions)
        ref_cos, ref_sin = hf(torch.zeros(1), ids[None])
        cos, sin = table[first_row + ids].chunk(2, dim=-1)
        torch.testing.assert_close(torch.cat((cos, cos), -1), ref_cos[0], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat((sin, sin), -1), ref_sin[0], rtol=0, atol=0)


def test_the_set_follows_the_sequence_length():
    config = tiny_config("phi3", **{k: v for k, v in SPEC.items() if k != "arch"})
    rope = LongRope.of(config)
    assert rope == LongRope(original_context=ORIGINAL, table_rows=POSITIONS)
    assert [rope.set_for(n) for n in (1, ORIGINAL, ORIGINAL + 1, POSITIONS)] == [0, 0, 1, 1]
    assert LongRope.of(tiny_config("phi3", max_position_embeddings=POSITIONS)) is None

    sets = RopeSets(rope)
    reqs = [Req(rid=str(n), origin_input_ids=[5] * n, sampling_params=SamplingParams()) for n in (ORIGINAL, 300)]
    for req in reqs:
        sets.choose(req)
    assert [r.rope_set for r in reqs] == [0, 1]
    assert [r.cache_namespace for r in reqs] == [None, ("rope_set", 1)]
    assert sets.row_offsets(reqs) == [0, POSITIONS]
    # Decoding: a short-set request outgrows it when its next step computes position ORIGINAL.
    for req, kv_len in zip(reqs, (ORIGINAL - 1, 300), strict=True):
        req.kv = KVSpan(row=0, kv_len=kv_len, num_cached=0, last_node=None)
    assert sets.outgrown(reqs) == []
    reqs[0].kv.kv_len = ORIGINAL
    assert sets.outgrown(reqs) == [reqs[0]]

    one_set = RopeSets(None)
    one_set.choose(reqs[1])
    assert reqs[1].rope_set == 1  # untouched
    assert one_set.outgrown(reqs) == [] and one_set.row_offsets(reqs) is None


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_each_token_reads_the_rows_of_its_requests_set(mode: ForwardMode):
    transfer = HostTransfer(CPU)
    pool = ReqToTokenPool(4, 32, CPU, transfer)
    prefix, extend = ([0, 3], [2, 3]) if mode is ForwardMode.EXTEND else ([4, 9], [1, 1])
    slots = list(range(1, sum(extend) + 1))

    def launch(offsets: list[int] | None) -> BatchPlan:
        return BatchPlan.launch(mode, [1, 2], prefix, extend, [0], offsets, pool, transfer, slots)

    positions = [0, 1, 3, 4, 5] if mode is ForwardMode.EXTEND else [4, 9]
    rows = [0, 1, 103, 104, 105] if mode is ForwardMode.EXTEND else [4, 109]
    batch = launch([0, 100]).build(pool, kv_pool=None)
    assert batch.positions.tolist() == positions and batch.rope_rows.tolist() == rows
    for one_set in (None, [0, 0]):  # no rows of their own: the positions themselves
        batch = launch(one_set).build(pool, kv_pool=None)
        assert batch.rope_table_rows is None and batch.rope_rows is batch.positions
