"""Scheduler behaviour: identical outputs across cache, paging, chunking,
policy and retraction; the admission order of each schedule policy;
prefix-cache accounting; aborts; the memory invariant at every step."""

from __future__ import annotations

import pytest
from generation_utils import generate, make_scheduler, mixed_prompts, run, submit
from helpers_pool import SchedulerPool, assert_whole_pool_back

from radixserve.hooks import hookimpl
from radixserve.messages import FinishReason
from radixserve.registry import PluginRegistry
from radixserve_torch.attention import TorchNativeAttention

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir):
    # Shared prefixes (so the radix cache and lpm matter) and ragged lengths.
    shared = mixed_prompts(512, [5, 17, 33], seed=11, shared_prefix=24)
    fresh = mixed_prompts(512, [3, 41, 9], seed=12)
    return shared + fresh


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts):
    scheduler = make_scheduler(tiny_llama_dir)
    return [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)]


CONFIGS = {
    "no-radix-cache": dict(disable_radix_cache=True),
    "page-16": dict(page_size=16),
    "chunked-16": dict(chunked_prefill_size=16),
    "lpm": dict(schedule_policy="lpm"),
    "priority": dict(schedule_policy="priority"),
    "page-16-chunked-16-lpm": dict(page_size=16, chunked_prefill_size=16, schedule_policy="lpm"),
    "no-cache-chunked-16": dict(disable_radix_cache=True, chunked_prefill_size=16),
    "max-running-2": dict(max_running_requests=2),
    # The reference runs without overlap (the cpu platform's default); these overlap.
    "overlap": dict(disable_overlap_schedule=False),
    "overlap-page-16-chunked-16-lpm": dict(
        disable_overlap_schedule=False, page_size=16, chunked_prefill_size=16, schedule_policy="lpm"
    ),
    "overlap-max-running-2": dict(disable_overlap_schedule=False, max_running_requests=2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_identical_across_configs(tiny_llama_dir, prompts, reference, name):
    scheduler = make_scheduler(tiny_llama_dir, **CONFIGS[name])
    results = generate(scheduler, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert [r.output_ids for r in results] == reference


# Arrival order "a", "b", "c": (cached prefix tokens after warming, priority).
# Each policy serves them in a different order.
POLICY_REQUESTS = {"a": (0, 1), "b": (10, 0), "c": (30, 2)}
POLICY_ORDER = {"fcfs": ["a", "b", "c"], "priority": ["c", "a", "b"], "lpm": ["c", "b", "a"]}


@pytest.mark.parametrize("policy", list(POLICY_ORDER))
def test_policy_decides_admission_order(tiny_llama_dir, policy):
    scheduler = make_scheduler(tiny_llama_dir, schedule_policy=policy, max_running_requests=1)
    warm, *tails = mixed_prompts(512, [40, 20, 20, 20], seed=21)
    generate(scheduler, [warm], max_new_tokens=1)  # the cache now holds `warm`
    rids = {}
    for (name, (cached, priority)), tail in zip(POLICY_REQUESTS.items(), tails, strict=False):
        rids[submit(scheduler, warm[:cached] + tail, priority=priority, max_new_tokens=2, temperature=0.0)] = name
    admitted: list[str] = []
    finished = []
    while scheduler.has_work():
        finished += [o for o in scheduler.step() if o.finish_reason is not None]
        admitted += [rids[r.rid] for r in scheduler.running if rids[r.rid] not in admitted]
        assert len(scheduler.running) <= 1
    assert admitted == POLICY_ORDER[policy]
    assert [rids[o.rid] for o in finished] == POLICY_ORDER[policy]  # one at a time: finished in that order
    cached = {rids[o.rid]: o.cached_tokens for o in finished}
    assert cached == {name: c for name, (c, _) in POLICY_REQUESTS.items()}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("page_size,chunk", [(1, -1), (16, -1), (1, 8), (16, 16)])
def test_retraction_when_kv_runs_out_keeps_outputs(tiny_llama_dir, prompts, reference, page_size, chunk, overlap):
    # Enough for any one request, far too little for all six at once; an
    # optimistic decode estimate admits too many, so running ones must retract
    # (with chunking, also while a long prompt is being prefilled in chunks).
    scheduler = make_scheduler(
        tiny_llama_dir,
        max_total_tokens=160,
        page_size=page_size,
        chunked_prefill_size=chunk,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
        disable_overlap_schedule=not overlap,
    )
    results = generate(scheduler, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert scheduler.totals.retracted_reqs > 0, "the pool was meant to be too small"
    assert [r.output_ids for r in results] == reference
    assert all(r.finish_reason.type == "length" for r in results)


@pytest.mark.parametrize("page_size", [1, 16])
def test_repeated_prompt_reports_cached_tokens(tiny_llama_dir, page_size):
    scheduler = make_scheduler(tiny_llama_dir, page_size=page_size)
    prompt = mixed_prompts(512, [45], seed=5)[0]
    first = generate(scheduler, [prompt], max_new_tokens=4)[0]
    second = generate(scheduler, [prompt], max_new_tokens=4)[0]
    assert first.cached_tokens == 0
    expected = (len(prompt) - 1) // page_size * page_size
    assert second.cached_tokens == expected
    assert second.output_ids == first.output_ids
    stats = scheduler.stats()
    assert stats.cached_tokens_total == expected and stats.memory_invariant_ok


def test_waiting_tokens_are_the_prompt_tokens_left_to_compute(tiny_llama_dir):
    """What a load report says the queue will prefill: not a prefix the cache holds, and
    a prefix the waiting requests share only once (the planner computes it once)."""
    scheduler = make_scheduler(tiny_llama_dir, max_running_requests=1)
    system, other, shared = mixed_prompts(512, [40, 20, 24], seed=9)
    (done,) = generate(scheduler, [system], max_new_tokens=1)
    questions = [q for q in mixed_prompts(512, [6, 7, 8, 9], seed=10) if q[0] != done.output_ids[0]][:2]
    running = submit(scheduler, other, max_new_tokens=30, ignore_eos=True)  # holds the one running slot
    scheduler.step()
    assert [r.rid for r in scheduler.running] == [running]
    queued = [system + questions[0], system + questions[1], shared + [17, 18], shared + [19]]
    for prompt in queued:
        submit(scheduler, prompt, max_new_tokens=1)
    left = len(questions[0]) + len(questions[1]) + len(shared) + 3
    assert scheduler.stats().num_waiting_tokens == left
    assert scheduler.stats(exact=False).num_waiting_tokens == sum(map(len, queued))
    run(scheduler)
    assert scheduler.stats().num_waiting_tokens == 0


def test_radix_cache_off_reports_no_cached_tokens(tiny_llama_dir):
    scheduler = make_scheduler(tiny_llama_dir, disable_radix_cache=True)
    prompt = mixed_prompts(512, [20], seed=5)[0]
    generate(scheduler, [prompt], max_new_tokens=2)
    assert generate(scheduler, [prompt], max_new_tokens=2)[0].cached_tokens == 0
    assert scheduler.ledger.allocator.available_size() == scheduler.ledger.total


def test_abort_waiting_and_running_requests_frees_memory(tiny_llama_dir):
    scheduler = make_scheduler(tiny_llama_dir, max_running_requests=2)
    prompts = mixed_prompts(512, [10, 12, 14], seed=8)
    rids = [submit(scheduler, p, max_new_tokens=50, temperature=0.0, ignore_eos=True) for p in prompts]
    earlier = [out for _ in range(3) for out in scheduler.step()]
    assert [r.rid for r in scheduler.running] == rids[:2] and scheduler.waiting[0].rid == rids[2]
    scheduler.abort(rids[0])  # running
    scheduler.abort(rids[2])  # waiting
    assert scheduler.check_memory()
    results = run(scheduler, earlier=earlier)
    assert results[rids[0]].finish_reason.type == "abort"
    assert results[rids[2]].finish_reason.type == "abort" and results[rids[2]].output_ids == []
    assert results[rids[1]].finish_reason.type == "length" and len(results[rids[1]].output_ids) == 50
    assert_whole_pool_back(SchedulerPool(scheduler))


def test_the_whole_pool_check_catches_a_leaked_lock(tiny_llama_dir):
    """What every abort test ends with fails on a lock left behind, although the
    pages under a locked node still count as cached: the ledger's invariant
    checks every lock against the requests that hold one, and a flush refuses."""
    scheduler = make_scheduler(tiny_llama_dir)
    prompt = mixed_prompts(512, [20], seed=5)[0]
    generate(scheduler, [prompt], max_new_tokens=2)
    cache = scheduler.ledger.cache
    leaked = cache.match_prefix(prompt).last_node
    cache.inc_lock_ref(leaked)  # as a release that forgot to unlock would leave it
    pool = SchedulerPool(scheduler)
    stats = pool.stats()
    assert stats["free_tokens"] + stats["private_tokens"] + stats["cached_tokens_in_tree"] == stats["max_total_tokens"]
    assert not stats["memory_invariant_ok"] and "lock_ref 1, requests pin it 0 times" in stats["memory_error"]
    with pytest.raises(AssertionError, match="did not settle"):
        assert_whole_pool_back(pool)
    assert not pool.flush()
    cache.dec_lock_ref(leaked)
    assert_whole_pool_back(pool)


def test_chunked_prefill_prompt_logprobs_match_unchunked(tiny_llama_dir):
    prompt = mixed_prompts(512, [50], seed=9)[0]
    outs = []
    for chunk in (None, 16):
        scheduler = make_scheduler(tiny_llama_dir, chunked_prefill_size=chunk or -1)
        rid = submit(scheduler, prompt, return_logprob=True, logprob_start_len=0, max_new_tokens=3, temperature=0.0)
        outs.append(run(scheduler)[rid])
    plain, chunked = outs
    assert plain.input_logprobs[0] == (None, prompt[0])
    assert [t for _, t in plain.input_logprobs] == prompt
    assert len(chunked.input_logprobs) == len(prompt)
    for (a, ta), (b, tb) in zip(plain.input_logprobs[1:], chunked.input_logprobs[1:], strict=False):
        assert ta == tb and abs(a - b) < 1e-5


def test_prompt_logprobs_are_computed_even_when_prefix_is_cached(tiny_llama_dir):
    scheduler = make_scheduler(tiny_llama_dir)
    prompt = mixed_prompts(512, [30], seed=10)[0]
    generate(scheduler, [prompt], max_new_tokens=2)  # warm the cache
    rid = submit(scheduler, prompt, return_logprob=True, logprob_start_len=20, max_new_tokens=2, temperature=0.0)
    result = run(scheduler)[rid]
    assert [t for _, t in result.input_logprobs] == prompt[20:]
    assert all(lp is not None and lp <= 0 for lp, _ in result.input_logprobs)
    assert result.cached_tokens <= 19


def test_prefill_only_request_caches_prompt(tiny_llama_dir):
    scheduler = make_scheduler(tiny_llama_dir)
    prompt = mixed_prompts(512, [25], seed=4)[0]
    warm = generate(scheduler, [prompt], max_new_tokens=0)[0]
    assert warm.output_ids == [] and warm.finish_reason == FinishReason("length")
    assert generate(scheduler, [prompt], max_new_tokens=2)[0].cached_tokens == len(prompt) - 1


def test_oversized_prompt_is_rejected_not_hung(tiny_llama_dir):
    scheduler = make_scheduler(tiny_llama_dir, max_total_tokens=32)
    rid = submit(scheduler, list(range(20, 60)), max_new_tokens=2)
    result = run(scheduler)[rid]
    assert result.finish_reason.type == "abort" and result.finish_reason.status_code == 400
    assert result.finish_reason.message.startswith("input_ids:") and "the pool holds 32" in result.finish_reason.message


class CountingAttention(TorchNativeAttention):
    name = "counting"
    calls = 0

    def forward(self, q, k, v, layer, batch):
        CountingAttention.calls += 1
        return super().forward(q, k, v, layer, batch)


class CountingPlugin:
    @hookimpl
    def register_attention_backends(self, register):
        register(CountingAttention)


def test_plugin_backend_selected_by_name_generates_reference_output(tiny_llama_dir, prompts, reference):
    registry = PluginRegistry()
    registry.register_plugin(CountingPlugin(), "counting-plugin")
    scheduler = make_scheduler(tiny_llama_dir, registry=registry, attention_backend="counting")
    assert scheduler.runner.summary()["backends"]["attention"] == "counting"
    results = generate(scheduler, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert [r.output_ids for r in results] == reference
    assert CountingAttention.calls > 0


def test_chunked_prefill_yields_memory_to_decoding_requests(tiny_llama_dir):
    """A long prompt being prefilled in chunks holds pages a decoding request
    needs: the chunked prompt must step back (and resume), not the decoder be
    aborted. Each request alone fits the 64-token pool."""
    short = mixed_prompts(512, [30], seed=61)[0]
    long = mixed_prompts(512, [60], seed=62)[0]
    reference = generate(make_scheduler(tiny_llama_dir), [short, long], max_new_tokens=30, ignore_eos=True)
    reference[1].output_ids = reference[1].output_ids[:3]
    scheduler = make_scheduler(tiny_llama_dir, max_total_tokens=64, chunked_prefill_size=16)
    rids = [
        submit(scheduler, short, max_new_tokens=30, temperature=0.0, ignore_eos=True),
        submit(
            scheduler,
            long,
            max_new_tokens=3,
            temperature=0.0,
            ignore_eos=True,
            return_logprob=True,
            logprob_start_len=0,
        ),
    ]
    results = run(scheduler)
    assert [results[r].finish_reason.type for r in rids] == ["length", "length"]
    assert [results[r].output_ids for r in rids] == [reference[0].output_ids, reference[1].output_ids]
    assert scheduler.totals.retracted_reqs > 0
    # Prompt logprobs survive the retraction: one per prompt token, no duplicates.
    assert [t for _, t in results[rids[1]].input_logprobs] == long


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_abort_while_a_step_computes_frees_memory(tiny_llama_dir, overlap):
    """With overlap a step is still computing between two ``step()`` calls; an
    abort then (of a decoding request, and of a prefill-only one that is in no
    queue yet) frees everything, and the other request is unaffected."""
    scheduler = make_scheduler(tiny_llama_dir, disable_overlap_schedule=not overlap)
    long_prompt, short_prompt, warm_prompt = mixed_prompts(512, [30, 8, 20], seed=31)
    keep = submit(scheduler, long_prompt, max_new_tokens=20, temperature=0.0, ignore_eos=True)
    victim = submit(scheduler, short_prompt, max_new_tokens=20, temperature=0.0, ignore_eos=True)
    earlier = scheduler.step() + scheduler.step()
    warm = submit(scheduler, warm_prompt, max_new_tokens=0)
    earlier += scheduler.step()  # the prefill-only request's step may still be computing
    scheduler.abort(victim)
    scheduler.abort(warm)
    assert scheduler.check_memory(), scheduler.stats()
    results = run(scheduler, earlier=earlier)
    assert results[victim].finish_reason.type == "abort"
    assert (
        results[keep].output_ids
        == generate(make_scheduler(tiny_llama_dir), [long_prompt], max_new_tokens=20, ignore_eos=True)[0].output_ids
    )
    assert_whole_pool_back(SchedulerPool(scheduler))
