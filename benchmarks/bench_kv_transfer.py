"""A KV-transfer backend's speed over loopback: one room's latency (``send`` until both
sides are DONE) and the bytes per second, for prompts of several lengths, in a model's
KV shape, between two pools in this process (each end's thread does the network work,
as in a worker).

    python benchmarks/bench_kv_transfer.py [--backend tcp] [--tokens 128 512 2048 8192] [--concurrent 4]

The default shape is Llama-3-8B's KV (32 layers, 8 KV heads of 128, bfloat16: 128 KiB
a token). With ``--concurrent N`` N rooms of the middle length go at once as well.

``--backend mooncake`` (plugins/mooncake): run it with ``RADIXSERVE_MOONCAKE_HOST=127.0.0.2``
so that the sender's engine is not the receiver's (Mooncake keeps one engine per host
in a process, and one engine writing into its own memory copies it locally).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from radixserve.cache.memory_pool import KVPool
from radixserve.kernels.kv_transfer import KVSide, TransferState
from radixserve.registry import get_registry


def pool_and_side(ns: argparse.Namespace, tokens: int) -> tuple[KVPool, KVSide]:
    dtype = getattr(torch, ns.dtype)
    pool = KVPool(
        tokens // ns.page_size + 1, ns.page_size, ns.layers, ns.kv_heads, ns.head_dim, dtype, torch.device("cpu")
    )
    side = KVSide("cpu", ns.dtype, ns.layers, ns.head_dim, ns.kv_heads, (0, ns.kv_heads), ns.page_size)
    return pool, side


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="tcp")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--concurrent", type=int, default=4)
    ns = p.parse_args()
    largest = max(ns.tokens) * max(ns.concurrent, 1)
    sender_pool, side = pool_and_side(ns, largest)
    receiver_pool, _ = pool_and_side(ns, largest)
    for buffer in (*sender_pool.k_buffers, *sender_pool.v_buffers):
        buffer.normal_()
    backend = get_registry().kv_transfer_backend(ns.backend, side)
    receiver = backend.open_receiver(receiver_pool, side, "127.0.0.1")
    sender = backend.open_sender(sender_pool, side)
    sender.connect(receiver.endpoint, 10)
    bytes_per_token = KVPool.bytes_per_token(ns.layers, ns.kv_heads, ns.head_dim, getattr(torch, ns.dtype))
    room = 0

    def run(tokens: int, rooms: int) -> float:
        """Seconds from the first send until every room is DONE on both sides."""
        nonlocal room
        ids = list(range(room, room + rooms))
        room += rooms
        started = time.perf_counter()
        for i, r in enumerate(ids):
            slots = torch.arange(i * tokens, (i + 1) * tokens) + ns.page_size
            receiver.expect(r, slots, 600)
            sender.send(r, slots, [receiver.endpoint], 600, b"first token")
        while not all(end.poll(r).finished for r in ids for end in (sender, receiver)):
            time.sleep(0.0005)
        elapsed = time.perf_counter() - started
        assert all(end.poll(r).state is TransferState.DONE for r in ids for end in (sender, receiver))
        for r in ids:
            sender.forget(r)
            receiver.forget(r)
        return elapsed

    try:
        run(ns.tokens[0], 1)  # connections and code paths warm
        cases = [(tokens, 1) for tokens in ns.tokens]
        if ns.concurrent > 1:
            cases.append((ns.tokens[len(ns.tokens) // 2], ns.concurrent))
        for tokens, rooms in cases:
            times = [run(tokens, rooms) for _ in range(ns.repeats)]
            median = statistics.median(times)
            size = tokens * rooms * bytes_per_token
            print(
                json.dumps(
                    {
                        "backend": ns.backend,
                        "tokens": tokens,
                        "rooms": rooms,
                        "mib": round(size / 2**20, 1),
                        "seconds_median": round(median, 4),
                        "seconds_min": round(min(times), 4),
                        "gib_per_s": round(size / median / 2**30, 2),
                    }
                ),
                flush=True,
            )
    finally:
        sender.close()
        receiver.close()


if __name__ == "__main__":
    main()
