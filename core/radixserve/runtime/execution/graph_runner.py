"""Decode steps replayed from device graphs captured at start-up.

A decode step is the same chain of small kernels every time, and on a GPU
launching them one by one from Python costs more than running them. The
platform's ``GraphBackend`` (CUDA graphs on ``cuda``; none on ``cpu``) records
the whole model forward once per batch size over **static buffers**, and each
decode step then copies its inputs into those buffers and replays the graph: a
handful of copies and one launch instead of hundreds.

- **Batch sizes** (``capture_batch_sizes``): 1, 2, 4, 8, then every 8 up to
  256 and every 16 beyond, ending exactly at ``--graph-max-bs`` (by default
  ``--max-running-requests``). A decode batch of ``n`` requests replays the
  graph of the smallest size ``>= n``; larger decode batches and every extend
  batch run eagerly.
- **Static buffers**, sized for the largest batch and shared by every graph:
  ``input_ids``, ``positions`` (also the prefix lengths: in decode a request's
  new token sits right after its cached ones), ``out_cache_loc``,
  ``req_pool_indices``, ``seq_lens``, ``extend_lens`` (all ones), and for a
  LongRoPE model ``rope_rows`` (each token's row of the rotary table, in its
  request's set). Each captured size sees the first rows of them, and the
  attention backend keeps its own static metadata (``init_graph_state``).
- **Padding**: rows past the real batch read request row 0 with ``seq_len`` 1
  at position 0 and write their K/V to slot 0, in the reserved KV page 0, so
  they touch nothing a request owns; their logits are sliced off.
- **No host lists in the graph**: the captured batches have empty
  ``seq_lens_cpu`` / ``prefix_lens_cpu`` / ``extend_lens_cpu``, since a graph
  cannot depend on values the host reads per step. Only while the backend's
  replay hook runs does the batch carry ``seq_lens_cpu`` (the real lengths, then
  1 per padding row), which the host knows without a sync: backends that plan
  on the host (FlashInfer) read it there; the recorded work never sees it.
- Graphs are captured largest first, so the smaller ones reuse the memory the
  largest one took from the backend's shared pool.

The logits a replay returns are a view of the graph's static output: valid
until the next forward, which is how the model worker uses them (it samples
before launching the next step).
"""

from __future__ import annotations

import bisect
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from radixserve.cache.memory_pool import KVPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels.attention import AttentionBackend
from radixserve.platform import DeviceGraph, GraphBackend

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The captured decode batch sizes up to ``max_bs`` (see the module docstring)."""
    if max_bs < 1:
        raise ValueError(f"graph_max_bs: must be >= 1, got {max_bs}")
    sizes, size = [], 1
    while size < max_bs:
        sizes.append(size)
        size = size * 2 if size < 8 else size + (8 if size < 256 else 16)
    return sizes + [max_bs]


def padded_batch_size(sizes: list[int], n: int) -> int | None:
    """The smallest captured size that holds ``n`` requests (None: ``n`` is above them all)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class _Captured:
    batch: ForwardBatch  # views of the static buffers, the batch the graph was recorded with
    graph: DeviceGraph
    logits: torch.Tensor  # [bs, vocab], rewritten by every replay


class GraphRunner:
    """Captures the decode forward at every size of ``capture_batch_sizes(max_bs)``
    and replays it for the decode batches that fit. ``rope_rows``: the model's
    batches may read rotary rows other than their positions (LongRoPE), so the
    graphs read them from a buffer of their own."""

    def __init__(
        self,
        model: Callable[[ForwardBatch], torch.Tensor],
        attention: AttentionBackend,
        backend: GraphBackend,
        max_bs: int,
        req_to_token: torch.Tensor,
        kv_pool: KVPool,
        device: torch.device,
        rope_rows: bool = False,
    ):
        self.model, self.attention, self.backend = model, attention, backend
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.req_to_token, self.kv_pool, self.device = req_to_token, kv_pool, device

        def buffer(fill: int) -> torch.Tensor:
            return torch.full((max_bs,), fill, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.out_cache_loc = buffer(0), buffer(0), buffer(0)
        self.req_pool_indices, self.seq_lens, self.extend_lens = buffer(0), buffer(1), buffer(1)
        self._inputs: tuple[tuple[torch.Tensor, str, int], ...] = (  # (static buffer, batch field, padding)
            (self.input_ids, "input_ids", 0),
            (self.positions, "positions", 0),
            (self.out_cache_loc, "out_cache_loc", 0),
            (self.req_pool_indices, "req_pool_indices", 0),
            (self.seq_lens, "seq_lens", 1),
        )
        self.rope_rows = buffer(0) if rope_rows else None
        if self.rope_rows is not None:
            self._inputs += ((self.rope_rows, "rope_rows", 0),)
        self._graphs: dict[int, _Captured] = {}
        self.capture_seconds = 0.0

    def capture(self) -> None:
        """Record every size, largest first, with a progress bar on a terminal.
        Call under ``torch.inference_mode()`` and the platform's forward context."""
        from tqdm import tqdm

        if not hasattr(tqdm, "_lock"):  # as in checkpoints.loader: no multiprocessing lock to leak
            tqdm.set_lock(threading.RLock())
        start = time.perf_counter()
        self.attention.init_graph_state(self.max_bs, self.req_to_token.shape[1], self.device)
        sizes = sorted(self.batch_sizes, reverse=True)
        for bs in tqdm(
            sizes,
            desc=f"Capturing {self.backend.name} graphs",
            unit="graph",
            file=sys.stderr,
            disable=not sys.stderr.isatty(),
        ):
            batch = self._static_batch(bs)

            def forward(b: ForwardBatch = batch) -> torch.Tensor:
                return self.model(b)

            try:
                self.attention.init_forward_metadata_capture(batch)
                graph, logits = self.backend.capture(forward)
            except Exception as exc:
                raise RuntimeError(
                    f"graph capture failed at decode batch size {bs} ({self.backend.name}, attention backend "
                    f"{self.attention.name!r}): {exc}; --disable-graph runs every step eagerly"
                ) from exc
            self._graphs[bs] = _Captured(batch, graph, logits)
        self.capture_seconds = time.perf_counter() - start

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.positions[:bs],
            extend_lens=self.extend_lens[:bs],
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            rope_table_rows=self.rope_rows[:bs] if self.rope_rows is not None else None,
        )

    def can_run(self, batch: ForwardBatch) -> bool:
        """A decode batch within the captured sizes whose logits are every request's, in order."""
        if batch.mode is not ForwardMode.DECODE or not 0 < batch.batch_size <= self.max_bs:
            return False
        return batch.logits_indices is None or batch.logits_indices.numel() == batch.batch_size

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits ``[batch.batch_size, vocab]`` for a batch that ``can_run``."""
        n = batch.batch_size
        bs = cast(int, padded_batch_size(self.batch_sizes, n))  # can_run: n fits a captured size
        for static, name, pad in self._inputs:
            static[:n].copy_(getattr(batch, name))
            if bs > n:
                static[n:bs].fill_(pad)
        captured = self._graphs[bs]
        captured.batch.seq_lens_cpu = list(batch.seq_lens_cpu) + [1] * (bs - n)
        try:
            self.attention.init_forward_metadata_replay(captured.batch)
        finally:
            captured.batch.seq_lens_cpu = []
        captured.graph.replay()
        return captured.logits[:n]

    def summary(self) -> dict[str, Any]:
        return {
            "backend": self.backend.name,
            "batch_sizes": list(self.batch_sizes),
            "capture_seconds": round(self.capture_seconds, 3),
        }
