"""A node other than node 0 (``radixserve serve --node-rank N``, N > 0): it runs
its share of the tensor-parallel ranks and no HTTP server. Its ranks take their
messages from rank 0 on node 0, so the node only starts them and watches them.

It exits 0 when its ranks leave on node 0's ShutdownRequest, and 1, with the
reason, when one of them fails (a peer lost, a collective timed out, a crash)
or a start-up fails; SIGTERM/SIGINT stop its ranks (node 0 then loses them and
shuts its group down with that reason).
"""

from __future__ import annotations

import logging
import signal
import threading
from multiprocessing.connection import wait as wait_any
from typing import Any

from radixserve.checkpoints.source import resolve_model_path
from radixserve.config import ServerArgs
from radixserve.runtime.processes.spawn import spawn_runtime, wait_until_ready

logger = logging.getLogger(__name__)

WAKE_S = 0.5


def serve_worker_node(args: ServerArgs) -> int:
    """Start this node's ranks, print ``radixserve node N ready`` once they have
    joined the group and loaded the model, and wait; returns the exit code.
    StartupError when a rank fails to start."""
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        logger.info("signal %d: stopping this node's ranks", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    model_path = resolve_model_path(args)
    runtime, ready = spawn_runtime(args, model_path)
    wait_until_ready(runtime, ready)
    ranks = ", ".join(f"{p.name} (pid {p.pid})" for p in runtime.ranks)
    print(
        f"radixserve node {args.node_rank} ready: {ranks} of tp_size {args.tp_size}, node 0 at {args.dist_init_addr}",
        flush=True,
    )
    try:
        while not stop.is_set():
            exited = wait_any([p.sentinel for p in runtime.ranks], timeout=WAKE_S)
            if not exited:
                continue
            dead = [p for p in runtime.ranks if p.sentinel in exited]
            reason = runtime.death_reason(dead)
            if all(p.exitcode == 0 for p in dead):
                logger.info("node 0 shut the group down (%s)", reason)
                return 0
            print(f"radixserve: error: node {args.node_rank}: {reason}", flush=True)
            return 1
        return 0
    finally:
        runtime.shutdown()
