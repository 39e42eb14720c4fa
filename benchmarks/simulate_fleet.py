"""The router's policies over a simulated fleet (``radixserve.router.simulation``): for
each fleet size and policy, one run of the same workload, and a markdown table of
TTFT, throughput, the fleet's cache hit rate, each device class's share of requests
and prompt tokens, the spread between equal workers, the policy's decision time per
request and its prefix tree's size.

    python benchmarks/simulate_fleet.py --workers 16 128 1024 --requests 100000

The arrival rate is ``--load`` times the fleet's nominal capacity (each worker's
``DeviceClass.requests_per_s`` for the mix's mean request, no cache hits), so the same
load means the same pressure at every size; shared-prefix groups grow with the fleet
(``--groups-per-worker``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from radixserve.load_balance import ROUTER_POLICIES
from radixserve.router.args import RouterArgs
from radixserve.router.simulation.devices import CLASSES, DeviceClass
from radixserve.router.simulation.report import Figures, markdown_header, markdown_row
from radixserve.router.simulation.simulator import FleetSimulation
from radixserve.router.simulation.workload import Mix, Workload


def fleet(workers: int, shares: dict[str, float]) -> list[DeviceClass]:
    """``workers`` devices, each class's share of them (the first class takes the rest)."""
    counts = {name: round(workers * share) for name, share in shares.items()}
    first = next(iter(counts))
    counts[first] += workers - sum(counts.values())
    return [CLASSES[name] for name, count in counts.items() for _ in range(count)]


def parse_shares(text: str) -> dict[str, float]:
    shares = {}
    for part in text.split(","):
        name, _, share = part.partition(":")
        if name not in CLASSES:
            raise argparse.ArgumentTypeError(f"unknown device class {name!r} (known: {', '.join(CLASSES)})")
        shares[name] = float(share)
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--requests", type=int, nargs="+", default=[100_000], help="one count, or one per --workers")
    parser.add_argument("--policies", nargs="+", default=list(ROUTER_POLICIES), choices=ROUTER_POLICIES)
    parser.add_argument("--classes", type=parse_shares, default=parse_shares("cpu:0.5,cpu/2:0.25,cpu/4:0.25"))
    parser.add_argument("--load", type=float, default=0.7, help="arrival rate as a fraction of nominal capacity")
    parser.add_argument("--shared-prefix", type=float, default=1.0, help="weight of shared-prefix arrivals")
    parser.add_argument("--chat", type=float, default=1.0, help="weight of chat-session arrivals")
    parser.add_argument("--long-document", type=float, default=1.0, help="weight of long-document arrivals")
    parser.add_argument("--groups-per-worker", type=float, default=1.0)
    parser.add_argument("--max-tree-size", type=int, default=RouterArgs.max_tree_size)
    parser.add_argument("--max-tree-total-chars", type=int, default=RouterArgs.max_tree_total_chars)
    parser.add_argument("--load-poll-interval", type=float, default=RouterArgs.load_poll_interval_secs)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    counts = args.requests * len(args.workers) if len(args.requests) == 1 else args.requests
    if len(counts) != len(args.workers):
        parser.error("--requests: give one count, or one per --workers")

    for workers, requests in zip(args.workers, counts, strict=True):
        devices = fleet(workers, args.classes)
        mix = Mix(
            shared_prefix=args.shared_prefix,
            chat=args.chat,
            long_document=args.long_document,
            groups=max(1, round(workers * args.groups_per_worker)),
        )
        prompt, answer = mix.mean_request()
        rate = args.load * sum(d.requests_per_s(prompt, answer) for d in devices)
        print(f"\n### {workers} workers, {requests:,} requests at {rate:,.1f} req/s (load {args.load})\n", flush=True)
        classes = list(dict.fromkeys(d.name for d in devices))
        print(markdown_header(classes, {c: sum(d.name == c for d in devices) / workers for c in classes}), flush=True)
        simulated = 0.0
        for policy in args.policies:
            router_args = RouterArgs(
                policy=policy,
                max_tree_size=args.max_tree_size,
                max_tree_total_chars=args.max_tree_total_chars,
                load_poll_interval_secs=args.load_poll_interval,
            )
            workload = Workload(mix, requests, rate, seed=args.seed)
            simulation = FleetSimulation(router_args, devices, workload, args.block_size, seed=args.seed)
            started = time.perf_counter()
            simulation.run()
            figures = Figures.of(policy, simulation, time.perf_counter() - started)
            simulated = figures.simulated_s
            print(markdown_row(figures, classes), flush=True)
        print(f"\nsimulated {simulated:,.0f} s (the last policy's run); mix {dataclasses.asdict(mix)}", flush=True)


if __name__ == "__main__":
    main()
