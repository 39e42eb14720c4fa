"""``--plot FILE.png``: CDFs of TTFT, ITL and end-to-end latency, and output
throughput over the run. Needs matplotlib (``pip install "radixserve[bench]"``)."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from radixserve.bench.metrics import RequestResult


def require_matplotlib() -> ModuleType:
    """pyplot, or a ValueError naming the flag (checked before a run, not after it)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            'plot: needs matplotlib; install it with pip install "radixserve[bench]" (or pip install matplotlib)'
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_results(results: list[RequestResult], path: str, title: str) -> None:
    require_matplotlib()
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    series = {
        "TTFT (ms)": [1000 * r.ttft for r in done],
        "ITL (ms)": [1000 * gap for r in done for gap in r.itls],
        "end-to-end latency (s)": [r.e2e for r in done],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=False):
        ordered = np.sort(values)
        ax.step(ordered, np.arange(1, len(ordered) + 1) / max(len(ordered), 1), where="post")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    start = min((r.sent for r in done), default=0.0)
    times = np.sort([t - start for r in done for t in r.token_times])
    if len(times):
        width = max(times[-1] / 50, 0.05)
        counts, edges = np.histogram(times, bins=np.arange(0, times[-1] + width, width))
        ax.plot(edges[:-1] + width / 2, counts / width)
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
