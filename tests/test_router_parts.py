"""The router's parts on their own: the prefix tree, the circuit breaker, admission,
the policies and what the router reads from a request. The whole router, with real
workers, is tests/test_router.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.load_balance import DP_POLICIES, POLICIES, ROUTER_POLICIES, Load, LoadBalancer
from radixserve.router.admission import Admission
from radixserve.router.args import RouterArgs
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policies import CacheAware, CapacityAware, RoutingRequest, make_policy
from radixserve.router.prefix_tree import PrefixTree
from radixserve.router.request_info import TokenEstimator, read_request, usage_prompt_tokens
from radixserve.router.worker import (
    CAPACITY_HALF_LIFE_S,
    BreakerState,
    CircuitBreaker,
    Work,
    Worker,
    WorkerFacts,
    WorkerLoad,
)
from radixserve.server.errors import APIError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---- prefix tree ---------------------------------------------------------------------
def _reference_match(sent: dict[str, list[str]], text: str) -> dict[str, int]:
    """The longest common prefix of ``text`` with anything each worker was sent."""
    out = {}
    for worker, texts in sent.items():
        best = max((len(_lcp(t, text)) for t in texts), default=0)
        if best:
            out[worker] = best
    return out


def _lcp(a: str, b: str) -> str:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return a[:i]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("AB"), st.text("xyz", max_size=12)), max_size=30), st.text("xyz", max_size=12)
)
def test_tree_match_is_the_longest_common_prefix_per_worker(inserts, query):
    tree = PrefixTree(max_chars=10**9)
    sent: dict[str, list[str]] = {}
    for worker, text in inserts:
        tree.insert(text, worker)
        sent.setdefault(worker, []).append(text)
    assert tree.match(query) == _reference_match(sent, query)
    for worker, texts in sent.items():  # each worker is credited with the size of its own text's trie
        trie = {t[:i] for t in texts for i in range(1, len(t) + 1)}
        assert tree.chars[worker] == len(trie)
    assert tree.total_chars == sum(tree.chars.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 39), st.text("xyz", min_size=1, max_size=30)), max_size=60))
def test_the_whole_tree_stays_under_its_fleet_bound_however_many_workers(inserts):
    tree = PrefixTree(max_chars=10**9, max_total_chars=120)
    for worker, text in inserts:
        tree.insert(text, f"w{worker}")
        assert tree.total_chars == sum(tree.chars.values()) <= 120
        assert tree.match(text)[f"w{worker}"] == len(text) or tree.chars[f"w{worker}"] < len(text)


def test_past_the_fleet_bound_the_worker_credited_with_most_gives_way():
    clock = Clock()
    tree = PrefixTree(max_chars=10**9, max_total_chars=200, clock=clock)
    for i in range(4):  # "big" holds 160 characters, the least recent first
        clock.now = i
        tree.insert(f"{i}" * 40, "big")
    clock.now = 10
    tree.insert("s" * 30, "small")  # 190: within the bound
    assert tree.chars == {"big": 160, "small": 30}
    tree.insert("t" * 30, "small")  # 220: "big" is cut to its share of 0.9 x 200 (90), its oldest text first
    assert tree.chars["small"] == 60 and tree.chars["big"] <= 90 and tree.total_chars <= 200
    assert "big" not in tree.match("0" * 40) and tree.match("3" * 40) == {"big": 40}


def test_tree_forgets_the_least_recent_text_beyond_its_bound():
    clock = Clock()
    tree = PrefixTree(max_chars=100, clock=clock)
    for i, text in enumerate(["a" * 40, "b" * 40, "c" * 40]):
        clock.now = i
        tree.insert(text, "w")
    assert tree.chars["w"] <= 100
    assert "w" not in tree.match("a" * 40)  # the oldest went first
    assert tree.match("c" * 40) == {"w": 40}
    tree.remove_worker("w")
    assert tree.match("c" * 40) == {} and not tree.root.children


# ---- circuit breaker -----------------------------------------------------------------
def test_breaker_opens_after_failures_half_opens_after_timeout_and_closes_on_success():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, success_threshold=1, open_seconds=10, clock=clock)
    for _ in range(2):
        breaker.on_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.allows()
    breaker.on_success()  # consecutive failures only
    for _ in range(3):
        breaker.on_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now = 10
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_send()
    assert not breaker.allows()  # one trial at a time
    breaker.on_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now = 20
    breaker.on_send()
    breaker.on_undecided()  # the trial's client left, or another worker failed it: no verdict
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_send()
    breaker.on_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allows()


# ---- admission -----------------------------------------------------------------------
def test_admission_queues_then_refuses_with_429_and_times_out_with_408():
    async def scenario() -> None:
        admission = Admission(max_concurrent=1, rate=None, queue_size=1, queue_timeout=0.3, metrics=RouterMetrics())
        await admission.acquire()  # the one place
        waiting = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as full:
            await admission.acquire()
        assert full.value.status == 429
        admission.release()  # the waiter gets the place
        await asyncio.wait_for(waiting, 1)
        with pytest.raises(APIError) as late:
            await admission.acquire()
        assert late.value.status == 408
        admission.release()
        assert admission.in_flight == 0

    asyncio.run(scenario())


def test_token_bucket_admits_at_its_rate():
    async def scenario() -> float:
        admission = Admission(max_concurrent=2, rate=20.0, queue_size=100, queue_timeout=5, metrics=RouterMetrics())
        loop = asyncio.get_running_loop()
        start = loop.time()
        for _ in range(12):  # 2 at once from the full bucket, then one per 50 ms
            await admission.acquire()
            admission.release()
        return loop.time() - start

    elapsed = asyncio.run(scenario())
    assert 0.4 < elapsed < 1.5


# ---- policies ------------------------------------------------------------------------
def _worker(url: str, decode: float | None = None, prefill: float | None = None) -> Worker:
    worker = Worker(url, WorkerFacts("m"), CircuitBreaker(5, 1, 10))
    worker.observe(WorkerLoad(decode_tokens_per_s=decode, prefill_tokens_per_s=prefill, reported_at=1.0))
    return worker


def test_capacity_aware_gives_a_worker_a_share_in_proportion_to_its_speed():
    """Each routed request adds its tokens to the worker's queue, as in-flight work does."""
    workers = [_worker("fast", 300.0, 3000.0), _worker("slow", 100.0, 1000.0)]
    policy = CapacityAware(PrefixTree(10**9))
    shares: Counter[str] = Counter()
    for i in range(400):
        request = RoutingRequest(f"prompt {i}", 50, 50)
        choice = policy.choose(request, workers)
        choice.worker.hold(choice.work(request), +1)
        shares[choice.worker.url] += 1
    assert shares["fast"] / shares["slow"] == pytest.approx(3.0, rel=0.1)


def test_capacity_aware_prefers_the_worker_that_caches_the_prefix_at_equal_queues():
    workers = [_worker("a", 100.0, 1000.0), _worker("b", 100.0, 1000.0)]
    policy = CapacityAware(PrefixTree(10**9))
    shared = "system prompt " * 50
    first = policy.choose(RoutingRequest(shared + "q1", 200, 10), workers).worker
    for i in range(2, 10):
        again = policy.choose(RoutingRequest(shared + f"q{i}", 200, 10), workers)
        assert again.worker is first and again.cached_tokens > 190  # credited with the shared part
    first.hold(Work(0, 10_000), +1)  # ...but not at any queue
    assert policy.choose(RoutingRequest(shared + "q10", 200, 10), workers).worker is not first


def test_capacity_is_the_recent_peak_of_the_measured_rate():
    worker = _worker("w", 100.0)
    worker.observe(WorkerLoad(decode_tokens_per_s=20.0, reported_at=1.0 + CAPACITY_HALF_LIFE_S))
    assert worker.decode_capacity.value == pytest.approx(50.0)  # the peak fades: by half after a half-life
    worker.observe(WorkerLoad(decode_tokens_per_s=20.0, reported_at=1.0 + 10 * CAPACITY_HALF_LIFE_S))
    assert worker.decode_capacity.value == pytest.approx(20.0)  # ...until the rate measured now is the larger
    worker.observe(WorkerLoad(decode_tokens_per_s=None, reported_at=2.0 + 10 * CAPACITY_HALF_LIFE_S))
    assert worker.decode_capacity.value is None  # not measured since a restart


def test_capacity_aware_weighs_prompt_work_by_the_prefill_rate():
    """Equal decode rates, one worker five times slower at prefill: long prompts avoid it
    until the fast one's queue is five times longer."""
    fast, slow_prefill = _worker("fast", 100.0, 5000.0), _worker("slow", 100.0, 1000.0)
    policy = CapacityAware(PrefixTree(10**9))
    shares: Counter[str] = Counter()
    for i in range(120):
        request = RoutingRequest(f"long prompt {i} " * 40, 2000, 1)
        choice = policy.choose(request, [fast, slow_prefill])
        choice.worker.hold(choice.work(request), +1)
        shares[choice.worker.url] += 1
    assert shares["fast"] / shares["slow"] == pytest.approx(5.0, rel=0.15)


def test_cache_aware_follows_the_prefix_and_balances_when_imbalanced():
    workers = [_worker("a"), _worker("b")]
    policy = CacheAware(PrefixTree(10**9), threshold=0.5, balance_abs=4, balance_rel=1.5)
    a = policy.choose(RoutingRequest("shared prefix / one", 5, 5), workers).worker
    assert policy.choose(RoutingRequest("shared prefix / two", 5, 5), workers).worker is a
    b = policy.choose(RoutingRequest("zzz unrelated", 5, 5), workers).worker
    assert b is not a  # a new prefix goes to the worker credited with less text
    a.in_flight = 20
    assert policy.choose(RoutingRequest("shared prefix / three", 5, 5), workers).worker is b


@pytest.mark.parametrize("name", ["round_robin", "shortest_queue", "minimum_tokens", "random", "power_of_two"])
def test_the_simple_policies_spread_over_all_workers(name):
    policy = make_policy(RouterArgs(policy=name), random.Random(0))
    workers = [_worker(u) for u in "abc"]
    seen = Counter(policy.choose(RoutingRequest("x", 1, 1), workers).worker.url for _ in range(300))
    assert set(seen) == {"a", "b", "c"} and min(seen.values()) > 50


def test_one_vocabulary_for_the_router_and_the_dp_controller():
    """--policy takes its choices from load_balance.POLICIES, SGLang's gateway's names (cache_aware,
    round_robin, random, power_of_two) and the DP controller's (round_robin, shortest_queue,
    minimum_tokens) among them, each help line with its meaning."""
    assert set(ROUTER_POLICIES) == set(POLICIES) and set(DP_POLICIES) <= set(ROUTER_POLICIES)
    assert {"cache_aware", "round_robin", "random", "power_of_two"} <= set(ROUTER_POLICIES)
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    action = next(a for a in parser._actions if a.dest == "policy")
    assert tuple(action.choices or ()) == ROUTER_POLICIES
    assert all(f"{name} ({POLICIES[name].meaning})" in (action.help or "") for name in ROUTER_POLICIES)
    for name in ROUTER_POLICIES:
        assert RouterArgs.from_cli_args(parser.parse_args(["--policy", name])).policy == name
    with pytest.raises(ValueError, match=r"^policy: must be one of capacity_aware, .*got 'fastest'"):
        RouterArgs(policy="fastest")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", DP_POLICIES)
def test_a_shared_policy_picks_for_the_router_what_it_picks_for_the_dp_controller(name):
    """The same loads (requests, tokens) give the same picks, ties in turn included."""
    load_sets = [[(3, 10), (1, 900), (2, 50)], [(0, 0), (0, 0), (0, 0)], [(2, 40), (2, 30), (5, 5)]]
    policy, balancer = make_policy(RouterArgs(policy=name)), LoadBalancer(name)
    workers = [_worker(u) for u in "abc"]
    for loads in load_sets * 2:
        for worker, (requests, tokens) in zip(workers, loads, strict=True):
            worker.in_flight, worker.in_flight_work = requests, Work(tokens, 0)
        routed = policy.choose(RoutingRequest("x", 1, 1), workers).worker.url
        dispatched = balancer.choose({k: Load(r, t) for k, (r, t) in enumerate(loads)})
        assert routed == "abc"[dispatched], (name, loads)


# ---- reading requests ----------------------------------------------------------------
@pytest.mark.parametrize(
    "route, payload, needs",
    [
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            {"structured_output": "response_format"},
        ),
        ("chat", {"response_format": {"type": "text"}}, {}),
        ("chat", {"tools": [{"type": "function"}], "tool_choice": "auto"}, {"tools": "tools"}),
        ("chat", {"tools": [{"type": "function"}], "tool_choice": "none"}, {}),
        ("completions", {"guided_regex": "[a-z]+"}, {"structured_output": "guided_regex"}),
        ("completions", {"logprobs": 2, "n": 3}, {"logprobs": "logprobs", "n": "n"}),
        (
            "generate",
            {"sampling_params": {"regex": "a|b"}, "return_logprob": True},
            {"structured_output": "regex", "logprobs": "return_logprob"},
        ),
    ],
)
def test_request_needs_name_the_field(route, payload, needs):
    body = {"model": "m", "messages": [], "prompt": "p", **payload} if route != "generate" else {"text": "t", **payload}
    assert read_request(route, body, TokenEstimator()).needs == {"generation": "model", **needs}


def test_an_embedding_request_needs_embeddings_and_routes_by_its_input():
    info = read_request("embeddings", {"model": "m", "input": ["a shared prefix", "b"]}, TokenEstimator())
    assert info.needs == {"embeddings": "model"}
    assert info.routing.text == "a shared prefix" and info.routing.max_tokens == 1


def test_routing_text_of_a_conversation_extends_its_prefix():
    estimator = TokenEstimator()
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    later = [
        *first,
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
    ]
    a = read_request("chat", {"model": "m", "messages": first}, estimator).routing.text
    b = read_request("chat", {"model": "m", "messages": later}, estimator).routing.text
    assert b.startswith(a) and len(b) > len(a)


@given(
    text=st.text(),
    prompt_tokens=st.integers(0, 10**9),
    spaced=st.booleans(),
    has_usage=st.booleans(),
)
def test_usage_prompt_tokens_is_read_from_the_answer_whatever_its_text(text, prompt_tokens, spaced, has_usage):
    """The router learns characters per token from each answer's usage without parsing
    the answer; a completion whose text spells the key does not fool it."""
    answer: dict = {"id": "x", "choices": [{"text": f'{text}"prompt_tokens": 7', "index": 0}]}
    if has_usage:
        answer["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "prompt_tokens_details": None}
    separators = (", ", ": ") if spaced else (",", ":")
    content = json.dumps(answer, separators=separators, ensure_ascii=False).encode()
    assert usage_prompt_tokens(content) == (prompt_tokens if has_usage else None)


def test_a_request_without_a_model_is_refused_naming_it():
    with pytest.raises(APIError) as exc:
        read_request("chat", {"messages": []}, TokenEstimator())
    assert exc.value.status == 400 and exc.value.param == "model"


@pytest.mark.parametrize("url, normal", [("127.0.0.1:8000", "http://127.0.0.1:8000"), ("http://h:1/", "http://h:1")])
def test_worker_urls_are_normalized(url, normal):
    assert RouterArgs(worker_urls=[url]).worker_urls == [normal]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(worker_urls=["ftp://x"]), "worker_urls"),
        (dict(cache_threshold=2.0), "cache_threshold"),
        (dict(max_concurrent_requests=0), "max_concurrent_requests"),
    ],
)
def test_bad_router_args_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        RouterArgs(**kwargs)
