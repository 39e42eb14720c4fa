"""The fleet simulation's event loop: the router's real policy in front of simulated
workers.

The router side is fed as the real router feeds it: each request's routing text and
token estimate (``RoutingRequest``) go to ``policy.choose`` over the fleet's
``router.worker.Worker``s; the chosen one ``hold``s the request's work from the moment
it is sent until its last token (a stream's end); every ``load_poll_interval_secs`` each
worker's load report (``SimulatedWorker.load_report``, or a ``reporter`` given) reaches
its ``Worker.observe``, so what the policy sees of a worker's queue and rates is up to
one interval old. The time ``choose`` takes is measured (``time.perf_counter``, and the
thread's CPU time, which a busy shared machine inflates less); it is the only real
time here: everything else runs on the simulated clock, and a request reaches its
worker at the instant it is routed."""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from radixserve.router.args import RouterArgs
from radixserve.router.policies import Policy, RoutingRequest, make_policy
from radixserve.router.simulation.devices import DeviceClass
from radixserve.router.simulation.sim_worker import SimulatedWorker
from radixserve.router.simulation.workload import CHARS_PER_TOKEN, SimRequest, Trace, Workload
from radixserve.router.worker import CircuitBreaker, Worker, WorkerFacts, WorkerLoad

# What a load report is made of; a richer one (rates per batch band) can be built from
# ``worker.device``'s curves, which the simulated worker knows exactly.
Reporter = Callable[[SimulatedWorker, float], WorkerLoad]

_ARRIVAL, _TURN, _WAKE, _POLL = range(4)  # event kinds


@dataclass
class Outcome:
    """What a run produced: the finished requests' figures and the router's decision times."""

    ttfts: list[float] = field(default_factory=list)
    decision_seconds: list[float] = field(default_factory=list)  # wall clock (perf_counter)
    decision_cpu_seconds: list[float] = field(default_factory=list)  # this thread's CPU (a shared machine's is fairer)
    kinds: dict[str, int] = field(default_factory=dict)
    first_arrival: float = math.inf
    last_finish: float = 0.0
    finished: int = 0


class FleetSimulation:
    def __init__(
        self,
        args: RouterArgs,
        devices: Sequence[DeviceClass],
        workload: Workload | Trace,
        block_size: int = 64,
        reporter: Reporter | None = None,
        seed: int = 0,
    ):
        self.args, self.workload = args, workload
        self.policy: Policy = make_policy(args, random.Random(seed))
        self.now = 0.0  # the simulated clock (the router's workers read it)
        self.sim_workers = [SimulatedWorker(f"http://sim-{i}", d, block_size) for i, d in enumerate(devices)]
        self.router_workers = [
            Worker(
                w.url,
                WorkerFacts(
                    model_id="sim",
                    device=w.device.name,
                    max_total_num_tokens=w.device.kv_tokens,
                    max_running_requests=w.device.max_running,
                    prefill_step_tokens=w.device.chunk_tokens,
                ),
                CircuitBreaker(args.cb_failure_threshold, args.cb_success_threshold, args.cb_timeout_duration_secs),
                clock=lambda: self.now,
            )
            for w in self.sim_workers
        ]
        self.reporter: Reporter = reporter or (lambda worker, now: worker.load_report(now))
        self._sim_of = {w.url: w for w in self.sim_workers}
        self._router_of = {w.url: w for w in self.router_workers}
        self._events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._planned: dict[str, int] = {}  # worker url -> the plan its wake-up in the queue is for
        self._unfinished = 0  # requests arrived (or to arrive) and not finished
        self.outcome = Outcome()

    def run(self) -> Outcome:
        arrivals = iter(self.workload.arrivals())
        self._push_next_arrival(arrivals)
        self._push(0.0, _POLL, None)  # the router reads every worker's load as it starts
        while self._events:
            now, _, kind, item = heapq.heappop(self._events)
            self.now = now
            if kind == _WAKE:
                worker = self._sim_of[item]  # type: ignore[index]
                if worker.plan == self._planned.get(worker.url) and worker.next_wake == now:
                    for request in worker.wake(now):
                        self._finish(request, now)
                    self._watch(worker)
            elif kind == _POLL:
                for sim, router in zip(self.sim_workers, self.router_workers, strict=True):
                    router.observe(self.reporter(sim, now))
                if self._unfinished:
                    self._push(now + self.args.load_poll_interval_secs, _POLL, None)
            else:
                assert isinstance(item, SimRequest)
                self._route(item, now)
                if kind == _ARRIVAL:
                    self._push_next_arrival(arrivals)
        return self.outcome

    def _route(self, request: SimRequest, now: float) -> None:
        text = request.text()
        routing = RoutingRequest(text, max(1, len(text) // CHARS_PER_TOKEN), request.output_tokens)
        started, started_cpu = time.perf_counter(), time.thread_time()
        choice = self.policy.choose(routing, self.router_workers)
        self.outcome.decision_seconds.append(time.perf_counter() - started)
        self.outcome.decision_cpu_seconds.append(time.thread_time() - started_cpu)
        router = choice.worker
        request.routed = choice.work(routing)
        router.hold(request.routed, +1)
        router.routed += 1
        worker = self._sim_of[router.url]
        worker.arrive(request, now)
        self._watch(worker)

    def _finish(self, request: SimRequest, now: float) -> None:
        self._router_of[request.worker.url].hold(request.routed, -1)
        outcome = self.outcome
        outcome.ttfts.append(request.first_token_at - request.arrival)
        outcome.kinds[request.kind] = outcome.kinds.get(request.kind, 0) + 1
        outcome.last_finish = max(outcome.last_finish, now)
        outcome.finished += 1
        self._unfinished -= 1
        follow_up = self.workload.follow_up(request, now)
        if follow_up is not None:
            self._unfinished += 1
            self._push(follow_up.arrival, _TURN, follow_up)

    def _push_next_arrival(self, arrivals: Iterator[SimRequest]) -> None:
        request = next(arrivals, None)
        if request is not None:
            self.outcome.first_arrival = min(self.outcome.first_arrival, request.arrival)
            self._unfinished += 1
            self._push(request.arrival, _ARRIVAL, request)

    def _watch(self, worker: SimulatedWorker) -> None:
        """Queue the worker's wake-up when its plan changed."""
        if worker.next_wake is not None and self._planned.get(worker.url) != worker.plan:
            self._planned[worker.url] = worker.plan
            self._push(worker.next_wake, _WAKE, worker.url)

    def _push(self, at: float, kind: int, item: object) -> None:
        heapq.heappush(self._events, (at, next(self._order), kind, item))
