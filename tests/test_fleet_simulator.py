"""The fleet simulator (radixserve.router.simulation): its worker model against
hand-computed queueing, its radix cache's hits and eviction, that every request ends
once, and that it drives the router's real policies (make_policy) as the router does."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict

import pytest

from radixserve.load_balance import RouterPolicy
from radixserve.router.args import RouterArgs
from radixserve.router.simulation.block_cache import BlockCache
from radixserve.router.simulation.devices import MEASURED, QUARTER, DeviceClass
from radixserve.router.simulation.report import Figures, spread
from radixserve.router.simulation.simulator import FleetSimulation
from radixserve.router.simulation.workload import Mix, Segment, SimRequest, Trace, Workload, block_keys
from radixserve.router.worker import Work

# 1,000 prompt tokens a second after 0.1 s a step; 10 ms a decode step whatever the batch.
PLAIN = DeviceClass(
    name="plain",
    prefill_fixed_s=0.1,
    prefill_s_per_token=0.001,
    decode_fixed_s=0.01,
    decode_s_per_request=0.0,
    decode_s_per_context_token=0.0,
    kv_tokens=100_000,
)
_ids = itertools.count(1_000_000)


def request(at: float, prompt: tuple[Segment, ...] | int, answer: int = 1) -> SimRequest:
    segments = (Segment(next(_ids), prompt),) if isinstance(prompt, int) else prompt
    return SimRequest(next(_ids), "test", at, segments, Segment(next(_ids), answer))


def simulate(
    requests: list[SimRequest], devices: list[DeviceClass], policy: RouterPolicy = "round_robin"
) -> FleetSimulation:
    simulation = FleetSimulation(RouterArgs(policy=policy), devices, Trace(requests), block_size=64)
    simulation.run()
    return simulation


def test_a_single_workers_ttft_is_the_hand_computed_queueing() -> None:
    a = request(0.0, 1000)  # prefill 0.1 + 1.0: first token at 1.1
    b = request(0.5, 500)  # waits for a: 1.1 + 0.1 + 0.5 = 1.7
    c = request(3.0, 3000)  # chunked: 0.1 + 2.048, then 0.1 + 0.952: 6.2
    d = request(10.0, 100, answer=101)  # first token at 10.2, then 100 decode steps of 10 ms
    e = request(10.255, 100)  # cuts d's decoding at the step ending 10.26: first token at 10.46
    simulation = simulate([a, b, c, d, e], [PLAIN])
    assert [r.first_token_at - r.arrival for r in (a, b, c, d, e)] == pytest.approx([1.1, 1.2, 3.2, 0.2, 0.205])
    assert d.finished_at == pytest.approx(10.2 + 0.06 + 0.2 + 0.94)  # 6 steps, e's prefill, the other 94
    assert simulation.outcome.ttfts == pytest.approx([1.1, 1.2, 3.2, 0.205, 0.2])  # in the order they ended


def test_the_worker_reports_what_it_measured_to_the_router() -> None:
    simulation = simulate([request(0.5 * i, 1000, answer=50) for i in range(8)], [PLAIN])
    router = simulation.router_workers[0]
    assert router.prefill_capacity.value is not None and 500 < router.prefill_capacity.value < 1000
    assert router.decode_capacity.value is not None
    assert router.load.reported_at > 0


def test_the_block_cache_evicts_unlocked_leaves_least_recent_first() -> None:
    cache = BlockCache(block_size=4)
    cache.lock([1, 2, 3])
    cache.lock([1, 2, 4])  # shares 1, 2
    assert cache.tokens == 16 and cache.evictable_tokens == 0
    cache.unlock([1, 2, 3])
    assert cache.evict(100) == 4  # 3 only: 1 and 2 are still read
    assert cache.match([1, 2, 3]) == 2
    cache.unlock([1, 2, 4])
    cache.lock([5])
    cache.unlock([5])  # the most recent
    assert cache.evict(4) == 4 and cache.match([1, 2, 4]) == 2  # the leaf 4 went first
    assert cache.evict(8) == 8 and cache.match([1]) == 0 and cache.match([5]) == 1


def test_block_keys_match_exactly_the_shared_leading_tokens() -> None:
    system, a, b = Segment(1, 100), Segment(2, 50), Segment(3, 50)
    one, two = block_keys((system, a), 32), block_keys((system, b), 32)
    assert len(one) == 4 and one[:3] == two[:3] and one[3] != two[3]  # 96 shared tokens; block 4 mixes a or b in


def test_a_shared_prefix_hits_on_its_worker_until_evicted() -> None:
    system = Segment(1, 1024)
    first, second = request(0.0, (system, Segment(2, 64))), request(5.0, (system, Segment(3, 64)))
    small = dataclasses.replace(PLAIN, kv_tokens=3000)
    # The cache holds 18 blocks (the system prompt's 16 and each question's); a 2,901-token
    # request needs 17 of them back: the questions' first (the leaves), then the system
    # prompt's from its end, so only its first block is left for the third request.
    flood = request(10.0, 2900)
    third = request(20.0, (system, Segment(4, 64)))
    simulation = simulate([first, second, flood, third], [small])
    assert (first.cached_tokens, second.cached_tokens, third.cached_tokens) == (0, 1024, 64)
    worker = simulation.sim_workers[0]
    assert worker.cached_tokens == 1024 + 64 and worker.reserved == 0 and worker.kv_in_use() <= small.kv_tokens


def test_every_request_ends_once_and_the_router_holds_nothing_after() -> None:
    mix = Mix(groups=8, document_tokens=(1000, 3000))
    workload = Workload(mix, requests=1500, rate=6.0, seed=3)
    devices = [MEASURED] * 4 + [QUARTER] * 2
    simulation = FleetSimulation(RouterArgs(policy="capacity_aware"), devices, workload)
    outcome = simulation.run()
    assert outcome.finished == 1500 == len(outcome.ttfts) == sum(outcome.kinds.values())
    assert set(outcome.kinds) == {"shared_prefix", "chat", "long_document"}
    assert sum(w.requests for w in simulation.sim_workers) == 1500
    assert sum(w.routed for w in simulation.router_workers) == 1500
    for sim, router in zip(simulation.sim_workers, simulation.router_workers, strict=True):
        assert not sim.waiting and not sim.running and sim.reserved == 0 and sim.next_wake is None
        assert router.in_flight == 0 and router.in_flight_work == Work(0, 0)
    assert all(t > 0 for t in outcome.ttfts)
    figures = Figures.of("capacity_aware", simulation, 1.0)
    assert 0 < figures.hit_rate < 1 and figures.tree is not None and figures.tree.nodes > 0
    assert sum(figures.request_share.values()) == pytest.approx(1.0)


def test_round_robin_gives_equal_workers_equal_shares() -> None:
    requests = [request(0.05 * i, 200, answer=8) for i in range(800)]
    simulation = simulate(requests, [MEASURED] * 8)
    assert [w.requests for w in simulation.sim_workers] == [100] * 8


def test_cache_aware_keeps_a_prefix_group_on_one_worker() -> None:
    systems = [Segment(i, 1024) for i in range(4)]
    requests = [request(0.5 * i, (systems[i % 4], Segment(next(_ids), 32)), answer=16) for i in range(200)]
    simulate(requests, [MEASURED] * 8, policy="cache_aware")
    workers_of: defaultdict[int, set[str]] = defaultdict(set)
    for r in requests:
        workers_of[r.prompt[0].id].add(r.worker.url)
    assert all(len(urls) == 1 for urls in workers_of.values())
    assert len({next(iter(urls)) for urls in workers_of.values()}) == 4  # new prefixes go to fresh workers
    assert sum(r.cached_tokens for r in requests) == 196 * 1024  # all but each group's first


def test_capacity_aware_gives_a_4x_slower_worker_less() -> None:
    requests = [request(0.2 * i, 600, answer=32) for i in range(600)]
    simulation = simulate(requests, [MEASURED, MEASURED, QUARTER], policy="capacity_aware")
    served = Counter({w.device.name: w.requests for w in simulation.sim_workers})
    assert served["cpu/4"] < 600 / 6  # under half of an equal third


def loaded(devices: list[DeviceClass], load: float, requests: int) -> FleetSimulation:
    """``latency_aware`` over ``devices`` serving prefix groups, chat sessions and long
    documents at ``load`` of their nominal capacity."""
    mix = Mix(groups=len(devices))
    prompt, answer = mix.mean_request()
    rate = load * sum(d.requests_per_s(prompt, answer) for d in devices)
    simulation = FleetSimulation(RouterArgs(policy="latency_aware"), devices, Workload(mix, requests, rate, seed=1))
    simulation.run()
    return simulation


def test_latency_aware_gives_equal_workers_equal_shares_with_prefix_groups_and_sessions() -> None:
    """Groups and sessions stick where their prefix is cached; the load each worker was
    given lately (its utilisation) evens the shares out over the run."""
    simulation = loaded([MEASURED] * 16, 0.6, 6000)
    requests = [w.requests for w in simulation.sim_workers]
    prompts = [w.prompt_tokens for w in simulation.sim_workers]
    assert spread(requests) < 0.2 and spread(prompts) < 0.15, (requests, prompts)  # 0.35 and 0.16 by the queue alone
    assert Figures.of("latency_aware", simulation, 1.0).hit_rate > 0.3  # groups still mostly stay


def test_latency_aware_gives_a_4x_slower_class_about_its_share_of_the_rates_at_high_load() -> None:
    """Three workers of one speed and four a quarter as fast (a quarter of the fleet's
    capacity); at 0.9 of the capacity the slow class takes about its share (by the queue
    snapshot alone it took 14% of the prompt tokens)."""
    simulation = loaded([MEASURED] * 3 + [QUARTER] * 4, 0.9, 4000)
    slow = sum(w.prompt_tokens for w in simulation.sim_workers if w.device is QUARTER)
    share = slow / sum(w.prompt_tokens for w in simulation.sim_workers)
    assert 0.8 * 0.25 < share < 1.2 * 0.25, share
