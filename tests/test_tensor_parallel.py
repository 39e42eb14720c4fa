"""Tensor parallelism on the CPU (gloo): tp=2 and tp=4 ranks, each a real process
joined by torch.distributed, produce what tp=1 produces (greedy tokens equal,
logprobs within 1e-4) for the dense and the MoE test architectures (Qwen2-MoE:
experts and a shared expert with its gate; DeepSeek-V2: latent attention with its
heads split and its latent replicated, a dense layer, experts and shared experts), under a
load with queueing, chunked prefill, radix cache hits and aborts; every rank
samples the same tokens; each rank reads only its shards of the checkpoint; a
rank that stops answering fails its peer's collective at the timeout."""

from __future__ import annotations

import time

import pytest
import torch
from helpers_eagle import copying_eagle3_head, copying_eagle_head
from helpers_lora import build_adapters, lora_paths
from helpers_tp import SAMPLED, RankPool, make_args, run_ranks, run_script
from transformers import AutoTokenizer

from radixserve.checkpoints.loader import check_tp_shapes, load_config, load_model, model_kernel_query
from radixserve.config import ServerArgs
from radixserve.layers.context import ModelContext
from radixserve.layers.weights import CheckpointTensor
from radixserve.registry import get_registry
from radixserve.runtime.execution.distributed import RankSpec, Rendezvous, host_store, join_group
from radixserve.runtime.scheduling.scheduler import Scheduler
from radixserve.startup_checks import check_startup
from radixserve.startup_error import StartupError

# DeepSeek-V2 with V2's compressed query (q_lora_rank), whose down-projection is replicated too.
SPECS = (dict(arch="llama"), dict(arch="qwen3_moe"), dict(arch="qwen2_moe"), dict(arch="deepseek_v2", q_lora_rank=24))


@pytest.fixture(scope="module")
def rank_pool():
    """Four rank processes for the module's groups (tp=2 uses the first two). Started after
    tp=1 has run here: importing beside it, they slowed its threads (OpenMP's, which spin) ~10x."""
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def model_dirs(tiny_model_factory):
    # 4 query heads and 2 KV heads: at tp=4 each KV head is replicated on two ranks.
    return [tiny_model_factory(**spec) for spec in SPECS]


@pytest.fixture(scope="module")
def reference(model_dirs):
    """tp=1 in this process."""
    results = {}
    for model_dir in model_dirs:
        args = make_args(model_dir, 1)
        results[str(model_dir)] = run_script(Scheduler(args, str(model_dir), AutoTokenizer.from_pretrained(model_dir)))
    return results


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_ranks_equal_tp1_under_load_with_aborts(model_dirs, reference, rank_pool, tp_size):
    ranks = run_ranks(rank_pool, model_dirs, tp_size)
    for model_dir in map(str, model_dirs):
        ref = reference[model_dir]
        assert {ref[rid].finish for rid in ("g0", "g7")} == {"abort"}
        for rank, answer in enumerate(ranks):
            got = answer[model_dir]
            assert set(got) == set(ref)
            # Every rank sampled exactly what rank 0 did (same seeds, identical gathered logits).
            for rid in SAMPLED:
                assert got[rid].output_ids == ranks[0][model_dir][rid].output_ids, (model_dir, rank, rid)
            for rid in (r for r in ref if r not in SAMPLED):
                assert got[rid].output_ids == ref[rid].output_ids, (model_dir, tp_size, rank, rid)
                assert got[rid].finish == ref[rid].finish
                assert got[rid].logprobs == pytest.approx(ref[rid].logprobs, abs=1e-4)


@pytest.mark.parametrize("algorithm", ["ngram", "draft", "eagle", "eagle3"])
def test_tp2_with_speculative_decoding_equals_tp1_without(model_dirs, reference, rank_pool, algorithm, tmp_path):
    """Speculation (docs/speculative.md) at tp=2, n-gram, a draft model (the target
    itself, unsharded on each rank) and EAGLE heads (unsharded, reading the gathered
    hidden states and using the target's sharded embedding, EAGLE-1's also its LM head;
    EAGLE-3's reading three layers' outputs): every rank
    proposes and keeps alike, so the greedy requests get tp=1's plain tokens, and the
    ranks sample alike."""
    llama = model_dirs[:1]
    spec = {"speculative_algorithm": algorithm.removesuffix("3"), "speculative_num_draft_tokens": 3}
    if algorithm == "draft":
        spec["speculative_draft_model_path"] = str(llama[0])
    if algorithm == "eagle":
        spec["speculative_eagle_path"] = str(copying_eagle_head(llama[0], tmp_path))
    if algorithm == "eagle3":
        spec["speculative_eagle_path"] = str(copying_eagle3_head(llama[0], tmp_path))
    ranks = run_ranks(rank_pool, llama, 2, **spec)
    ref = reference[str(llama[0])]
    for answer in ranks:
        got = answer[str(llama[0])]
        for rid in SAMPLED:
            assert got[rid].output_ids == ranks[0][str(llama[0])][rid].output_ids
        for rid in (r for r in ref if r not in SAMPLED):
            assert got[rid].output_ids == ref[rid].output_ids, rid
            assert got[rid].finish == ref[rid].finish
        steps, accepted = answer[f"speculation:{llama[0]}"]
        assert steps > 0 and accepted > 0, (steps, accepted)


def test_tp2_serves_lora_adapters_as_tp1_does(model_dirs, rank_pool, tmp_path_factory):
    """A load mixing four adapters and the base model (docs/lora.md): each rank holds its
    shard of every adapter (B's rows of a column-parallel projection, A's columns of a
    row-parallel one, whose partial update joins the all-reduce), and tp=2 makes tp=1's tokens."""
    llama = model_dirs[0]
    adapters = build_adapters(llama, tmp_path_factory.mktemp("tp-adapters"))
    names: list[str | None] = [None, *adapters]
    more = {"enable_lora": True, "lora_paths": lora_paths(adapters)}
    tokenizer = AutoTokenizer.from_pretrained(llama)
    ref = run_script(Scheduler(make_args(llama, 1, **more), str(llama), tokenizer), names)
    for answer in run_ranks(rank_pool, [llama], 2, adapters=names, **more):
        got = answer[str(llama)]
        for rid in (r for r in ref if r not in SAMPLED):
            assert got[rid].output_ids == ref[rid].output_ids, rid
            assert got[rid].logprobs == pytest.approx(ref[rid].logprobs, abs=1e-4)


def test_each_rank_reads_only_its_shards(tiny_model_factory, monkeypatch):
    model_dir = tiny_model_factory(arch="qwen3_moe")
    registry = get_registry()
    config = load_config(model_dir)
    read: list[int] = []
    original = CheckpointTensor.load

    def counting_load(self):
        tensor = original(self)
        read.append(tensor.numel())
        return tensor

    monkeypatch.setattr(CheckpointTensor, "load", counting_load)
    totals = []
    for tp_size, rank in ((1, 0), (2, 1)):
        read.clear()
        query = model_kernel_query(config, "cpu", torch.float32, tp_size=tp_size)
        ctx = ModelContext.create(registry, query, torch.device("cpu"), tp_rank=rank, tp_size=tp_size)
        model, _ = load_model(model_dir, ctx, registry, config=config)
        totals.append(sum(read))
        assert sum(read) == sum(p.numel() for p in model.parameters() if p.shape) - _padding(model)
    # Norms, routers and (replicated) KV projections are whole; everything else halves.
    assert totals[1] < 0.6 * totals[0]


def _padding(model) -> int:
    """Rows of the vocab-parallel tables beyond the vocabulary (zeros, never read)."""
    pad = 0
    for m in (model.model.embed_tokens, model.lm_head):
        pad += (m.rows_per_rank - (m.vocab_end - m.vocab_start)) * m.weight.shape[1]
    return pad


def test_tp_size_must_split_the_model(tiny_model_factory):
    model_dir = tiny_model_factory(arch="llama")
    config = load_config(model_dir)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    with pytest.raises(ValueError, match="tp_size: 3 ranks cannot split num_attention_heads 4 .*over 1, 2, 4 ranks$"):
        check_tp_shapes(config, 3)
    with pytest.raises(ValueError, match="tp_size: 8 ranks cannot split num_attention_heads"):
        check_tp_shapes(config, 8)
    check_tp_shapes(config, 4)  # 2 KV heads, each on two ranks
    # At start-up: the sizes that work, and a hint about --tp-size (not the one about --model).
    with pytest.raises(StartupError, match="this model splits over 1, 2, 4 ranks") as info:
        check_startup(ServerArgs(model_path=str(model_dir), device="cpu", tp_size=3))
    assert "--tp-size" in info.value.hint
    with pytest.raises(ValueError, match="nnodes: must divide tp_size"):
        ServerArgs(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1234")
    with pytest.raises(ValueError, match="dist_init_addr: is required"):
        ServerArgs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank: must be in"):
        ServerArgs(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1")


def _silent_rank(port: int, rank: int) -> tuple[str, float] | None:
    """Joins, then rank 1 stops taking part (a hung rank); rank 0 says how its broadcast ended."""
    group = join_group(
        RankSpec(rank, 2, rank, Rendezvous("127.0.0.1", port), 3.0), get_registry().resolve_platform("cpu")()
    )
    if rank == 1:
        time.sleep(30)
        return None
    start = time.monotonic()
    try:
        group.broadcast(["a message"])
        group.broadcast(["another"])  # rank 1 never takes this one
        return ("returned", time.monotonic() - start)
    except RuntimeError as exc:
        return (str(exc).splitlines()[0], time.monotonic() - start)


def test_a_hung_rank_fails_its_peer_at_the_timeout(rank_pool):
    """Last of the module: it leaves the pool's second process hung (the fixture kills it)."""
    store = host_store("127.0.0.1", 0, 30)
    rank_pool.start(_silent_rank, [(store.port, 0), (store.port, 1)])
    what, seconds = rank_pool.result(0, 120)  # TimeoutError: rank 0 is still waiting
    assert what != "returned" and seconds < 20, (what, seconds)
