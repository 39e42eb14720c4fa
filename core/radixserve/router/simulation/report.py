"""A simulation's figures per policy, and their markdown table."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.router.prefix_tree import PrefixTree
from radixserve.router.simulation.simulator import FleetSimulation


@dataclass(frozen=True)
class TreeSize:
    """The policy's prefix tree: what it holds, and the most its eviction lets it credit
    (``--max-tree-size`` characters per worker, ``--max-tree-total-chars`` in all)."""

    nodes: int
    chars: int  # of the edges (the text it stores once)
    credited_chars: int  # summed over the workers (a shared edge counts once per worker)
    bound_chars: int

    @classmethod
    def of(cls, tree: PrefixTree, workers: int) -> TreeSize:
        nodes = chars = 0
        stack = list(tree.root.children.values())
        while stack:
            node = stack.pop()
            nodes, chars = nodes + 1, chars + len(node.edge)
            stack.extend(node.children.values())
        bound = tree.max_chars * workers
        if tree.max_total_chars is not None:
            bound = min(bound, tree.max_total_chars)
        return cls(nodes, chars, sum(tree.chars.values()), bound)


@dataclass(frozen=True)
class Figures:
    policy: str
    workers: int
    requests: int
    simulated_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    output_tokens_per_s: float
    hit_rate: float  # the workers' cached prompt tokens over all prompt tokens
    request_share: dict[str, float]  # per device class
    prompt_share: dict[str, float]  # per device class: of prompt tokens
    worker_share: dict[str, float]  # per device class: of workers (for comparison)
    equal_spread: float  # the largest coefficient of variation of requests per worker within a class
    decision_mean_ms: float
    decision_p99_ms: float
    decision_cpu_mean_ms: float
    tree: TreeSize | None
    wall_s: float

    @classmethod
    def of(cls, policy: str, simulation: FleetSimulation, wall_s: float) -> Figures:
        outcome, workers = simulation.outcome, simulation.sim_workers
        by_class: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # workers, requests, prompt tokens
        per_worker: dict[str, list[int]] = defaultdict(list)
        for w in workers:
            counts = by_class[w.device.name]
            counts[0] += 1
            counts[1] += w.requests
            counts[2] += w.prompt_tokens
            per_worker[w.device.name].append(w.requests)
        requests = sum(w.requests for w in workers)
        prompt = sum(w.prompt_tokens for w in workers)
        duration = outcome.last_finish - outcome.first_arrival
        tree = getattr(simulation.policy, "tree", None)
        return cls(
            policy=policy,
            workers=len(workers),
            requests=requests,
            simulated_s=duration,
            ttft_p50_s=quantile(outcome.ttfts, 0.5),
            ttft_p99_s=quantile(outcome.ttfts, 0.99),
            output_tokens_per_s=sum(w.output_tokens for w in workers) / duration if duration > 0 else 0.0,
            hit_rate=sum(w.cached_tokens for w in workers) / prompt if prompt else 0.0,
            request_share={name: c[1] / requests for name, c in by_class.items()},
            prompt_share={name: c[2] / prompt for name, c in by_class.items()},
            worker_share={name: c[0] / len(workers) for name, c in by_class.items()},
            equal_spread=max(spread(counts) for counts in per_worker.values()),
            decision_mean_ms=1000 * sum(outcome.decision_seconds) / len(outcome.decision_seconds),
            decision_p99_ms=1000 * quantile(outcome.decision_seconds, 0.99),
            decision_cpu_mean_ms=1000 * sum(outcome.decision_cpu_seconds) / len(outcome.decision_cpu_seconds),
            tree=TreeSize.of(tree, len(workers)) if isinstance(tree, PrefixTree) else None,
            wall_s=wall_s,
        )


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def spread(counts: Sequence[int]) -> float:
    """The coefficient of variation (standard deviation over mean) of ``counts``."""
    mean = sum(counts) / len(counts)
    if mean == 0:
        return 0.0
    return math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts)) / mean


def markdown_header(classes: Sequence[str], worker_share: dict[str, float]) -> str:
    shares = " / ".join(f"{name} ({worker_share[name]:.0%} of workers)" for name in classes)
    header = (
        "| policy | TTFT p50 / p99 (s) | out tok/s | fleet hit | requests: " + shares + " | prompt tokens: same order "
        "| equal workers' CV | decision mean / p99 / CPU mean (ms) | tree nodes / chars (bound) |"
    )
    return header + "\n|" + "---|" * 9


def markdown_row(r: Figures, classes: Sequence[str]) -> str:
    tree = "-" if r.tree is None else f"{r.tree.nodes:,} / {r.tree.chars:,} ({r.tree.bound_chars:,})"
    return (
        f"| {r.policy} | {r.ttft_p50_s:.2f} / {r.ttft_p99_s:.2f} | {r.output_tokens_per_s:,.0f} "
        f"| {r.hit_rate:.1%} | {' / '.join(f'{r.request_share[c]:.1%}' for c in classes)} "
        f"| {' / '.join(f'{r.prompt_share[c]:.1%}' for c in classes)} | {r.equal_spread:.0%} "
        f"| {r.decision_mean_ms:.3f} / {r.decision_p99_ms:.3f} / {r.decision_cpu_mean_ms:.3f} | {tree} |"
    )
