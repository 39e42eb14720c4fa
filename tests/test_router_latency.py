"""``latency_aware``: placement by predicted time to first token, from rates the workers
measure per batch-size band. The policy on ``Worker`` objects fed with reported loads
(as the router's load loop feeds them); the band rates from a real scheduler's steps;
and a real fleet (two workers and the router on 127.0.0.1) whose ``/debug/decisions``
explains a placement."""

from __future__ import annotations

import contextlib
import random
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from generation_utils import make_scheduler, run, submit
from helpers_server import ServerProcess, wait_until

from radixserve.rate_bands import DECODE_BANDS, PREFILL_BANDS, band_entries
from radixserve.router.latency import DecisionLog, LatencyObjective
from radixserve.router.policies import (
    MATCHED_SCORED,
    NEAR_TIE,
    SAMPLED_SCORED,
    CapacityAware,
    LatencyAware,
    Policy,
    RoutingRequest,
)
from radixserve.router.prefix_tree import PrefixTree
from radixserve.router.worker import UTILISATION_HALF_LIFE_S, CircuitBreaker, Work, Worker, WorkerFacts, WorkerLoad
from radixserve.runtime.processes.dp_controller import total_stats
from radixserve.server.worker_info import load_entries

# A worker's speed by band, tokens/s: prefill by the step's prompt tokens, decode by its
# batch (a bigger batch yields more tokens a second, each step taking a little longer).
PREFILL_CURVE = (2000.0, 4000.0, 6000.0, 8000.0, 8000.0)
DECODE_CURVE = (20.0, 60.0, 200.0, 500.0, 800.0)


class Clock:
    """The fleet's time, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(
    clock: Clock,
    speed: float = 1.0,
    prefill: tuple[float, ...] = PREFILL_CURVE,
    decode: tuple[float, ...] = DECODE_CURVE,
    **load: Any,
) -> WorkerLoad:
    """A ``/get_load`` as the router reads it: band rates ``speed`` times the curves."""
    return WorkerLoad(
        prefill_band_rates=tuple(r * speed for r in prefill),
        decode_band_rates=tuple(r * speed for r in decode),
        reported_at=clock(),
        **load,
    )


def worker(url: str, clock: Clock, speed: float | None = 1.0, **report_kw: Any) -> Worker:
    """A worker that has reported ``speed`` times the curves (None: has reported nothing yet)."""
    w = Worker(url, WorkerFacts("m", prefill_step_tokens=2048), CircuitBreaker(5, 1, 10), clock=clock)
    if speed is not None:
        w.observe(report(clock, speed, **report_kw))
    return w


def route(policy: Policy, request: RoutingRequest, workers: list[Worker]) -> tuple[Worker, Work]:
    """Place ``request`` and hold its work on the chosen worker, as the forwarder does."""
    choice = policy.choose(request, workers)
    work = choice.work(request)
    choice.worker.hold(work, +1)
    return choice.worker, work


def test_equal_workers_get_equal_shares_whatever_throughput_they_report():
    """Worker a serves alone for a while, then b joins. Each tick both finish half the
    requests they hold (a bigger batch finishes more) and report: equal band rates, and a
    raw throughput that follows the batch each was given. capacity_aware, which believes
    the raw figure, keeps feeding the worker that got more; latency_aware reads only the
    bands, and the shares even out."""

    def shares_under(policy: Policy) -> Counter[str]:
        clock = Clock()
        a, b = worker("a", clock), worker("b", clock)
        held: dict[str, deque[Work]] = {"a": deque(), "b": deque()}
        shares: Counter[str] = Counter()  # of the last 200 requests
        for i in range(440):
            candidates = [a] if i < 40 else [a, b]
            chosen, work = route(policy, RoutingRequest(f"prompt {i} " + "x" * 200, 60, 32), candidates)
            held[chosen.url].append(work)
            shares[chosen.url] += i >= 240
            if i % 8 == 7:
                clock.now += 0.25
                for w in (a, b):
                    finished = (len(held[w.url]) + 1) // 2
                    for _ in range(finished):
                        w.hold(held[w.url].popleft(), -1)
                    raw = finished * 32 / 0.25  # the tokens it generated: more for a bigger batch
                    w.observe(report(clock, num_reqs=w.in_flight, decode_tokens_per_s=raw, prefill_tokens_per_s=raw))
        return shares

    ours = shares_under(LatencyAware(PrefixTree(10**9)))
    assert abs(ours["a"] - ours["b"]) <= 0.1 * 200, ours
    theirs = shares_under(CapacityAware(PrefixTree(10**9)))
    assert theirs["a"] > 1.3 * theirs["b"], theirs  # the feedback latency_aware removes


def test_a_weaker_worker_gets_a_share_in_proportion_to_its_rates():
    """One worker at a third of the other's rates in every band; requests pile up."""
    clock = Clock()
    flat = {"prefill": (3000.0,) * 5, "decode": (300.0,) * 5}
    workers = [worker("fast", clock, 1.0, **flat), worker("slow", clock, 1 / 3, **flat)]
    policy = LatencyAware(PrefixTree(10**9))
    shares = Counter(route(policy, RoutingRequest(f"p{i} " * 30, 100, 16), workers)[0].url for i in range(400))
    assert shares["fast"] / shares["slow"] == pytest.approx(3.0, rel=0.1), shares


def test_a_prefix_group_stays_on_its_worker_until_waiting_there_costs_more_than_prefilling_it_elsewhere():
    """A shared system prompt (about 500 tokens) with short questions: the group's home
    computes a few tokens a request, the other worker would compute all 500. The group
    stays home while the decode batch it waits behind grows; once a step there takes
    longer than the prefill elsewhere, the other worker gets one (the whole prompt), and
    from then on holds the prefix too."""
    clock = Clock()
    workers = [worker("a", clock), worker("b", clock)]
    decisions = DecisionLog(1000)
    policy = LatencyAware(PrefixTree(10**9), decisions)
    shared = "you are a helpful assistant. " * 72
    placed = []
    for i in range(120):  # 5 a second, each decoding long
        placed.append(route(policy, RoutingRequest(shared + f"question {i}?", 500, 16), workers)[0])
        clock.now += 0.2
    home = placed[0]
    stayed = next(i for i, w in enumerate(placed) if w is not home)
    assert stayed >= 8, stayed  # not spread at once, as a load balancer alone would
    log = decisions.last(1000)
    spread = log[stayed]
    by_url = {c["worker"]: c for c in spread["candidates"]}
    elsewhere, at_home = by_url[spread["chosen"]], by_url[home.url]
    assert elsewhere["cached_tokens"] == 0 and elsewhere["own_prefill_tokens"] >= 495  # the whole prompt
    assert at_home["cached_tokens"] >= 490 and at_home["total_s"] > elsewhere["total_s"]
    before = {c["worker"]: c for c in log[stayed - 1]["candidates"]}
    assert before[home.url]["total_s"] <= before[spread["chosen"]]["total_s"]
    later = [d for d in log[stayed + 1 :] if d["chosen"] == spread["chosen"]]
    assert later and all(
        next(c for c in d["candidates"] if c["worker"] == d["chosen"])["cached_tokens"] >= 490 for d in later
    )  # spread: the other worker holds the prefix now
    assert Counter(w.url for w in placed[stayed:])[home.url] > 0  # and home keeps serving it


def test_an_unmeasured_worker_gets_traffic_and_is_then_believed():
    """A worker that has reported no rates counts at the measured candidates' median."""
    clock = Clock()
    measured, new = worker("measured", clock), worker("new", clock, speed=None)
    decisions = DecisionLog(100)
    policy = LatencyAware(PrefixTree(10**9), decisions)
    shares = Counter(route(policy, RoutingRequest(f"q{i} " * 40, 100, 16), [measured, new])[0].url for i in range(40))
    assert shares["new"] >= 15, shares
    terms = {c["worker"]: c for c in decisions.last(1)[0]["candidates"]}
    assert terms["new"]["measured"] is False and terms["measured"]["measured"] is True
    assert terms["new"]["prefill_tokens_per_s"] == measured.prefill_curve.at(terms["new"]["prefill_step_tokens"])
    new.observe(report(clock, speed=0.1, num_reqs=new.in_flight))  # measured: ten times slower
    later = Counter(route(policy, RoutingRequest(f"r{i} " * 40, 100, 16), [measured, new])[0].url for i in range(60))
    assert later["new"] < later["measured"] / 4, later


def test_a_decision_scores_a_bounded_few_of_a_large_fleet_the_prefix_holders_among_them():
    """Of 300 workers, a decision scores the workers caching the request's prefix (the best
    few) and a few drawn at random: the same number at any fleet size, and a prefix
    group still finds its home."""
    clock = Clock()
    workers = [worker(f"w{i}", clock) for i in range(300)]
    decisions = DecisionLog(1000)
    policy = LatencyAware(PrefixTree(10**9), decisions, random.Random(0))
    shared = "you are a helpful assistant. " * 72
    placed = []
    for i in range(6):
        placed.append(route(policy, RoutingRequest(shared + f"question {i}?", 500, 16), workers)[0])
        clock.now += 1.0  # its queue drains
    placed += [route(policy, RoutingRequest(f"unique {i} " * 40, 100, 16), workers)[0] for i in range(40)]
    scored = [len(d["candidates"]) for d in decisions.last(1000)]
    assert max(scored) <= MATCHED_SCORED + SAMPLED_SCORED < len(workers) // 10, Counter(scored)
    assert len(set(placed[:6])) == 1  # the group stays on the worker caching its prefix
    assert len(set(placed[6:])) >= 30  # new prefixes spread over the fleet, not over the few scored first


def test_a_worker_given_more_than_its_share_lately_looks_slower():
    """Two idle workers with empty queues: the one that was given more prompt tokens in the
    last minutes has the higher utilisation, a queueing term, and loses new prefixes;
    its lead fades with the clock."""
    clock = Clock()
    busy, rested = worker("busy", clock, prefill=(8000.0,) * 5), worker("rested", clock, prefill=(8000.0,) * 5)
    for _ in range(100):  # 100 s of prefill
        busy.hold(Work(8000, 16), +1)
        busy.hold(Work(8000, 16), -1)
    clock.now += 120.0  # both queues drained long ago
    assert busy.queued_prefill() == rested.queued_prefill() == 0
    assert busy.utilisation() > 0.25 and rested.utilisation() == 0
    decisions = DecisionLog(1)
    chosen = LatencyAware(PrefixTree(10**9), decisions).choose(RoutingRequest("new " * 50, 100, 16), [busy, rested])
    assert chosen.worker is rested
    terms = {c["worker"]: c for c in decisions.last(1)[0]["candidates"]}
    assert terms["busy"]["queueing_s"] > 0 == terms["rested"]["queueing_s"]
    before = busy.utilisation()
    clock.now += UTILISATION_HALF_LIFE_S
    assert busy.utilisation() == pytest.approx(before / 2)


def test_equal_workers_share_new_prefix_groups_though_their_measured_rates_differ():
    """Two equal workers, one measured a sixth slower (as co-located workers' rates come
    out). A new prefix group every few seconds: the queues have drained each time, so the
    faster figure alone would win every group; within NEAR_TIE the work given decides,
    and the groups split evenly. Each group's follow-ups stay with it: a near tie never
    moves a request off its cached prefix."""
    clock = Clock()
    flat = {"prefill": (6000.0,) * 5, "decode": (300.0,) * 5}
    a, b = worker("a", clock, 1.0, **flat), worker("b", clock, 0.85, **flat)
    decisions = DecisionLog(1000)
    policy = LatencyAware(PrefixTree(10**9), decisions)
    homes: Counter[str] = Counter()
    for group in range(40):
        system = f"group {group} system prompt. " * 60
        first, work = route(policy, RoutingRequest(system + "first?", 600, 16), [a, b])
        homes[first.url] += 1
        first.hold(work, -1)
        for question in range(3):
            clock.now += 1.0  # the queues drain
            follower, work = route(policy, RoutingRequest(system + f"question {question}?", 600, 16), [a, b])
            assert follower is first, (group, question)
            follower.hold(work, -1)
    assert abs(homes["a"] - homes["b"]) <= 4, homes
    for decision in decisions.last(1000):
        terms = decision["candidates"]
        fastest = min(terms, key=lambda t: t["total_s"])
        chosen = next(t for t in terms if t["worker"] == decision["chosen"])
        assert chosen["total_s"] <= fastest["total_s"] * (1 + NEAR_TIE)
        assert chosen["own_prefill_tokens"] <= fastest["own_prefill_tokens"] * (1 + NEAR_TIE)


def test_the_queue_ahead_drains_at_the_prefill_rate_between_reports():
    clock = Clock()
    w = worker("w", clock, prefill=(8000.0,) * 5, num_waiting_tokens=4000)
    assert w.queued_prefill() == 4000
    w.hold(Work(1000, 16), +1)
    assert w.queued_prefill() == 5000  # sent since the report
    clock.now += 0.5  # at 8000 tokens/s
    assert w.queued_prefill() == pytest.approx(1000)
    clock.now += 1.0
    assert w.queued_prefill() == 0


def test_an_ended_request_is_not_waiting_though_the_newest_report_counted_it():
    """A request that ended has been prefilled: what the worker can still have waiting is
    the router's requests in flight plus what the last report counted beyond them (other
    routers' traffic), even before a newer report comes."""
    clock = Clock()
    w = worker("w", clock, prefill=(8000.0,) * 5, num_waiting_tokens=3000)  # 3000 from another router
    first, second = Work(6000, 16), Work(4000, 16)
    w.hold(first, +1)
    w.hold(second, +1)
    assert w.queued_prefill() == 13000
    w.observe(report(clock, prefill=(8000.0,) * 5, num_waiting_tokens=13000))  # counts all three
    w.hold(first, -1)
    assert w.queued_prefill() == 7000  # the second and the other router's
    w.hold(second, -1)
    assert w.queued_prefill() == 3000
    clock.now += 0.25
    assert w.queued_prefill() == pytest.approx(1000)  # the rest drains at the prefill rate
    silent = worker("silent", clock, speed=None)  # reports no load: only the router's own requests
    silent.hold(first, +1)
    silent.hold(first, -1)
    assert silent.queued_prefill() == 0


def test_a_full_running_batch_makes_a_request_wait_for_the_decode_ahead():
    """With every slot taken (--max-running-requests 2), a request waits for the output of
    the requests ahead of it: a worker with free slots wins even at a slower prefill."""
    clock = Clock()
    full = Worker("full", WorkerFacts("m", max_running_requests=2), CircuitBreaker(5, 1, 10), clock=clock)
    free = Worker("free", WorkerFacts("m", max_running_requests=64), CircuitBreaker(5, 1, 10), clock=clock)
    full.observe(report(clock, decode=(60.0,) * 5))
    free.observe(report(clock, speed=0.5, decode=(60.0,) * 5))
    for w in (full, free):
        for _ in range(3):
            w.hold(Work(0, 200), +1)
    decisions = DecisionLog(1)
    chosen = LatencyAware(PrefixTree(10**9), decisions).choose(RoutingRequest("hello", 10, 16), [full, free])
    assert chosen.worker is free
    terms = {c["worker"]: c for c in decisions.last(1)[0]["candidates"]}
    assert terms["full"]["requests_beyond_slots"] == 2 and terms["free"]["requests_beyond_slots"] == 0
    assert terms["full"]["decode_wait_s"] == pytest.approx(2 / 60 + 2 * 200 / 60)  # a step of 2, then 2 x 200 tokens


def test_a_latency_bound_request_goes_where_a_decode_step_gives_it_the_most_tokens():
    """Two workers, one speculative (its decode steps give a request 2.5 tokens at batch 1,
    2 up to 4, and 1 above: speculation off), the other with the faster prefill. A request
    without objectives takes the sooner first token; one with ``x-slo-tpot-ms`` 30 goes
    where a token comes every 20 ms rather than 50; once the speculative worker is busy,
    neither meets it, and the one that misses it by the least takes it."""
    clock = Clock()
    plain = worker("plain", clock)
    spec_output = tuple(rate * k for rate, k in zip(DECODE_CURVE, (2.5, 2.0, 1.0, 1.0, 1.0), strict=True))
    slow_prefill = tuple(rate * 0.5 for rate in PREFILL_CURVE)
    spec = worker("spec", clock, prefill=slow_prefill, decode_band_output_rates=spec_output)
    decisions = DecisionLog(8)
    policy = LatencyAware(PrefixTree(10**9), decisions)
    bound = LatencyObjective(tpot_s=0.030)
    assert policy.choose(RoutingRequest("first " * 40, 200, 64), [plain, spec]).worker is plain
    assert policy.choose(RoutingRequest("second " * 40, 200, 64, bound), [plain, spec]).worker is spec
    decision = decisions.last(1)[0]
    assert decision["objective"] == {"ttft_s": None, "tpot_s": 0.030}
    terms = {c["worker"]: c for c in decision["candidates"]}
    assert terms["spec"]["tpot_s"] == pytest.approx(1 / 50) and terms["plain"]["tpot_s"] == pytest.approx(1 / 20)
    assert terms["spec"]["ttft_s"] > terms["plain"]["ttft_s"]  # chosen for its tokens, not its first one
    for _ in range(20):
        spec.hold(Work(10, 200), +1)  # a batch of 21 to join: speculation is off there
    assert policy.choose(RoutingRequest("third " * 40, 200, 64, bound), [plain, spec]).worker is plain
    terms = {c["worker"]: c for c in decisions.last(1)[0]["candidates"]}
    assert terms["spec"]["tpot_s"] > terms["plain"]["tpot_s"] > 0.030


def test_a_request_with_a_ttft_objective_goes_to_a_worker_predicted_to_meet_it():
    """An idle worker with the slower prefill causes the least delay (on the busy one, the
    request's prefill would hold up the requests running there), but the busy one gives
    the sooner first token: a request with an ``x-slo-ttft-ms`` only the busy one meets
    goes there."""
    clock = Clock()
    idle_slow = worker("idle", clock, speed=0.6)
    busy_fast = worker("busy", clock)
    for _ in range(4):
        busy_fast.hold(Work(0, 100), +1)
    decisions = DecisionLog(4)
    policy = LatencyAware(PrefixTree(10**9), decisions)
    assert policy.choose(RoutingRequest("prompt " * 80, 600, 16), [idle_slow, busy_fast]).worker is idle_slow
    terms = {c["worker"]: c for c in decisions.last(1)[0]["candidates"]}
    assert terms["busy"]["ttft_s"] < terms["idle"]["ttft_s"] and terms["busy"]["imposed_s"] > 0
    objective = LatencyObjective(ttft_s=(terms["busy"]["ttft_s"] + terms["idle"]["ttft_s"]) / 2)
    assert policy.choose(RoutingRequest("other " * 80, 600, 16, objective), [idle_slow, busy_fast]).worker is busy_fast


def test_band_reports_are_read_back_and_replicas_add_up():
    none = [None] * 5
    prefill = band_entries(PREFILL_BANDS, [100.0, None, 300.0, None, None], [50.0, None, 600.0, None, None], "")
    outputs = [25.0, 20.0, None, None, None]  # a speculative worker's: 2.5 tokens a request at batch 1
    decode = band_entries(DECODE_BANDS, [10.0, 20.0, None, None, None], [1.0, 3.0, None, None, None], "", outputs)
    entry = {"num_reqs": 1, "prefill_bands": prefill, "decode_bands": decode}
    load = WorkerLoad.of([entry, {**entry, "decode_bands": decode[:2]}])  # the second: bands of other bounds
    assert (load.prefill_band_rates, load.prefill_band_sizes) == (
        (200.0, None, 600.0, None, None),
        (100.0, None, 1200.0, None, None),
    )
    assert (load.decode_band_rates, load.decode_band_sizes) == ((10.0, 20.0, *none[2:]), (1.0, 3.0, *none[2:]))
    w = Worker("w", WorkerFacts("m"), CircuitBreaker(5, 1, 10))
    w.observe(load)
    # A step's time: 0.5 s at 100 tokens, 2 s at 1200; between, interpolated; beyond, at the last rate.
    assert w.prefill_curve.at(650) == pytest.approx(650 / 1.25)
    assert w.prefill_curve.at(50) == pytest.approx(200.0) and w.prefill_curve.at(4000) == pytest.approx(600.0)
    assert w.decode_curve.at(2) == pytest.approx(2 / 0.125)  # 0.1 s a step at 1, 0.15 s at 3
    assert load.decode_band_output_rates == (25.0, 20.0, *none[2:])
    assert w.output_curve.at(1) == pytest.approx(25.0) and w.output_curve.at(3) == pytest.approx(20.0)
    plain = WorkerLoad.of([{"num_reqs": 0, "decode_bands": band_entries(DECODE_BANDS, [10.0] * 5, [1.0] * 5, "")}])
    assert plain.decode_band_output_rates == tuple(none)  # not reported: the decode curve stands in
    stats = {"decode_band_tokens_per_s": [1.0, None], "decode_band_sizes": [1.0, None]}
    assert total_stats({0: stats, 1: {"decode_band_tokens_per_s": [2.0, 3.0], "decode_band_sizes": [1.0, 4.0]}}) == {
        "decode_band_tokens_per_s": [3.0, 3.0],
        "decode_band_sizes": [2.0, 4.0],
    }


def test_the_scheduler_measures_each_band_from_its_steps(tiny_llama_dir: Path):
    """A real scheduler: one short prompt decoded alone, then three longer ones together;
    each lands in its band, and the router reads them back from the worker's report."""
    scheduler = make_scheduler(tiny_llama_dir)
    submit(scheduler, list(range(10, 50)), max_new_tokens=6, ignore_eos=True)
    run(scheduler)
    stats = scheduler.stats()
    assert stats.prefill_band_tokens_per_s[0] and not any(stats.prefill_band_tokens_per_s[1:])  # 40 tokens: <= 64
    assert stats.decode_band_tokens_per_s[0] and not any(stats.decode_band_tokens_per_s[1:])  # a batch of 1
    for first in (100, 250, 400):  # the tiny model's vocabulary is 512
        submit(scheduler, [(first + i) % 500 + 5 for i in range(200)], max_new_tokens=6, ignore_eos=True)
    run(scheduler)
    stats = scheduler.stats()
    assert stats.prefill_band_sizes[2] == 600 and stats.prefill_band_tokens_per_s[2]  # one step of 3 x 200
    assert stats.decode_band_tokens_per_s[1] and stats.decode_band_sizes[1] == 3  # a batch of 3: 2-4
    assert not any(stats.decode_band_tokens_per_s[2:])
    w = Worker("w", WorkerFacts("m"), CircuitBreaker(5, 1, 10))
    w.observe(WorkerLoad.of(load_entries({"stats": stats.__dict__})))
    alone, three = stats.decode_band_tokens_per_s[:2]
    assert w.decode_curve.at(1) == pytest.approx(alone)  # size / (size / rate): equal but for rounding
    assert w.decode_curve.at(3) == pytest.approx(3 / max(1 / alone, 3 / three))  # a step of 3 is not the quicker


# ---- a real fleet ------------------------------------------------------------------------
ADMIN = {"Authorization": "Bearer admin"}


@contextlib.contextmanager
def two_workers_and_a_router(model: Path) -> Iterator[tuple[list[ServerProcess], ServerProcess]]:
    common = ("--model", str(model), "--served-model-name", "tiny", "--max-total-tokens", "4096")
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(ServerProcess(*common)) for _ in range(2)]
        urls = [w.wait_ready() for w in workers]
        flags = ("--load-poll-interval-secs", "0.3", "--admin-api-key", "admin")
        router = stack.enter_context(ServerProcess("--worker-urls", *urls, *flags, command="router"))
        router.wait_ready(60)
        joined = lambda: len(httpx.get(router.url + "/workers", headers=ADMIN, timeout=10).json()["workers"]) == 2  # noqa: E731
        assert wait_until(joined, 60), router.log
        yield workers, router


def idle(router: ServerProcess) -> bool:
    """Every worker's last load report, as the router read it, shows no request, and the
    router counts no prompt tokens queued there (``queued_prefill_tokens``: the router's
    estimate; before an ended request's prompt stopped counting, a report predating the
    end left 96 tokens queued on the prefix's home at the next decision, and a CI run saw
    the home lose one)."""
    loads = httpx.get(router.url + "/get_loads", timeout=10).json()["workers"]
    return all(load["num_reqs"] == 0 and load["queued_prefill_tokens"] == 0 for load in loads)


def test_debug_decisions_explain_a_placement_on_a_real_fleet(tiny_llama_dir: Path):
    """A conversation's system prompt goes to one worker and its later requests follow it:
    the decisions show why (the prefix cached there, the whole prompt to compute on the
    other); the workers' /get_load carries the band rates the router learns."""
    with two_workers_and_a_router(tiny_llama_dir) as (workers, router):
        system = "You answer questions about the weather in a few words. " * 12
        for i in range(4):
            body = {
                "model": "tiny",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"day {i}?"}],
                "max_tokens": 6,
            }
            answer = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=300)
            assert answer.status_code == 200, answer.text
            assert wait_until(lambda: idle(router), 30)  # the router has seen the fleet idle again

        assert httpx.get(router.url + "/debug/decisions", timeout=10).status_code == 401  # an admin route
        got = httpx.get(router.url + "/debug/decisions", params={"limit": 3}, headers=ADMIN, timeout=10).json()
        assert got["policy"] == "latency_aware" and len(got["decisions"]) == 3
        for decision in got["decisions"]:
            terms = {c["worker"]: c for c in decision["candidates"]}
            assert set(terms) == {w.url for w in workers}
            chosen, other = terms.pop(decision["chosen"]), next(iter(terms.values()))
            assert chosen["total_s"] < other["total_s"]  # the least predicted TTFT...
            assert chosen["cached_tokens"] > 0 and other["cached_tokens"] == 0  # ...because the prefix is cached
            assert chosen["own_prefill_tokens"] < other["own_prefill_tokens"]
            parts = chosen["prefill_s"] + chosen["decode_wait_s"] + chosen["queueing_s"]
            assert chosen["total_s"] == pytest.approx(parts)
        home = got["decisions"][-1]["chosen"]
        assert {d["chosen"] for d in got["decisions"]} == {home}

        # A latency-bound request: its objectives are in its decision, with each candidate's
        # predicted time per output token (a plain worker's: a token a request a step).
        headers = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "60000"}
        short = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        answer = httpx.post(router.url + "/v1/completions", json=short, headers=headers, timeout=300)
        assert answer.status_code == 200, answer.text
        bound = httpx.get(router.url + "/debug/decisions", params={"limit": 1}, headers=ADMIN, timeout=10).json()
        decision = bound["decisions"][0]
        assert decision["objective"] == {"ttft_s": 60.0, "tpot_s": 60.0}
        for terms in decision["candidates"]:  # an idle worker: it would decode alone, a token a step
            assert terms["running_requests"] == 0
            assert terms["tpot_s"] == pytest.approx(1 / terms["decode_tokens_per_s"])

        load = httpx.get(home + "/get_load", timeout=30).json()[0]
        assert [band["up_to"] for band in load["decode_bands"]] == [*DECODE_BANDS, None]
        assert load["decode_bands"][0]["tokens_per_s"] > 0 and any(b["tokens_per_s"] for b in load["prefill_bands"])
        first_band = load["decode_bands"][0]  # no speculation: a token per request a step
        assert first_band["output_tokens_per_s"] == pytest.approx(first_band["tokens_per_s"])
        facts = httpx.get(home + "/server_info", timeout=30).json()["worker"]
        assert facts["decode_bands"][0]["tokens_per_s"] > 0 and facts["max_running_requests"] >= 1

        def learned() -> bool:
            described = httpx.get(router.url + "/workers", headers=ADMIN, timeout=10).json()["workers"]
            return any(w["url"] == home and w["load"]["decode_bands"][0]["tokens_per_s"] for w in described)

        assert wait_until(learned, 30)  # the router read them from /get_load
