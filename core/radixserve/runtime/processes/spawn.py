"""Starts the runtime processes shared by the HTTP server and the offline Engine,
spawned (never forked), wired by ZMQ: the scheduler groups (one process per
tensor-parallel rank of this node; with --dp-size > 1 one group per replica,
behind the DP controller) and, on node 0, the detokenizer.

The tokenizer is loaded once, by the first scheduler rank, and shared with the
server (or Engine) and the detokenizer (``tokenizer_share.py``). A runtime may
be spawned *held* (``spawn_runtime(held=True)``): its ranks import torch and the
model code, then wait for ``RuntimeProcesses.release`` before they read the
model, so that the server can start them before its own start-up checks.
This module imports no torch, for the same reason.

A failure inside a child is reported as its exception's last line; full
tracebacks are logged at debug level only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import zmq

from radixserve.config import ServerArgs
from radixserve.ipc import Endpoints, push_socket
from radixserve.messages import ReplicaDown, ShutdownRequest
from radixserve.multinode_env import launcher_serves_store
from radixserve.runtime.processes.child import run_child
from radixserve.runtime.processes.detokenizer import run_detokenizer_process
from radixserve.runtime.processes.dp_controller import run_dp_controller_process
from radixserve.runtime.processes.scheduler_process import run_scheduler_process, scheduler_process_name
from radixserve.runtime.processes.tokenizer_share import import_tokenizer_modules
from radixserve.startup_error import StartupError

if TYPE_CHECKING:  # torch and transformers: imported where needed, so that the server can spawn a scheduler first
    from torch._C._distributed_c10d import TCPStore

    from radixserve.platform import Platform
    from radixserve.runtime.execution.distributed import RankSpec
    from radixserve.runtime.execution.model_plan import ModelPlan

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600
# How long the ranks get to leave their loops on a ShutdownRequest before they are terminated.
SHUTDOWN_GRACE_S = 5.0


def exception_summary(traceback_text: str) -> str:
    """The ``Type: message`` part of a formatted traceback (the last exception's,
    message lines included), with the type's module path left out."""
    lines = traceback_text.rstrip().splitlines()
    if not lines:
        return "no traceback"
    # The exception line is the last unindented line that follows a frame's indented lines.
    start = next(
        (
            i
            for i in range(len(lines) - 1, 0, -1)
            if lines[i] and not lines[i][0].isspace() and lines[i - 1].startswith("  ")
        ),
        0,
    )
    head, sep, rest = lines[start].partition(": ")
    exc_type = head.rsplit(".", 1)[-1]
    return "\n".join([f"{exc_type}: {rest}" if sep else exc_type, *lines[start + 1 :]])


@dataclass
class SchedulerGroup:
    """One scheduler group: this node's tensor-parallel ranks of one replica (the
    first being rank 0 on node 0, which takes the requests on
    ``endpoints.scheduler``); with --dp-size > 1, one replica."""

    dp_rank: int | None  # None without data parallelism
    endpoints: Endpoints
    processes: list[BaseProcess]
    store: Any | None = None  # the TCP store its ranks meet at, when this process serves it

    @property
    def name(self) -> str:
        return "the scheduler" if self.dp_rank is None else f"data-parallel replica {self.dp_rank}"


@dataclass
class RuntimeProcesses:
    args: ServerArgs
    model_path: str
    tokenizer_path: str
    endpoints: Endpoints
    summary: dict[str, Any]
    groups: list[SchedulerGroup] = field(default_factory=list)
    processes: list[BaseProcess] = field(default_factory=list)  # the groups', the controller, the detokenizer
    tokenizer: Any = None  # the first rank's, once every rank is ready (node 0 only)
    _detokenizer_tokenizer: Connection | None = None  # where the detokenizer waits for it
    _holds: list[Connection] = field(default_factory=list)  # where held ranks wait for release()
    _stopping: bool = False

    @property
    def leads(self) -> bool:
        """Whether this node runs rank 0 (which takes the requests)."""
        return self.args.node_rank == 0

    @property
    def ranks(self) -> list[BaseProcess]:
        """Every scheduler rank process on this node."""
        return [p for g in self.groups for p in g.processes]

    @property
    def held(self) -> bool:
        """Whether its ranks still wait for ``release``."""
        return bool(self._holds)

    def release(self, plan: ModelPlan | None = None) -> None:
        """Let the ranks of a held runtime read the model, the start-up checks
        passed: each is handed ``plan`` (the checks' own), else one made now
        (``plan_runtime``). Call it from the thread that spawned the runtime (the
        detokenizer it starts dies with that thread)."""
        if self.leads:
            self.start_detokenizer()
        plan = plan or plan_runtime(self.args, self.model_path)
        for hold in self._holds:
            hold.send(plan)
            hold.close()
        self._holds = []

    def start_detokenizer(self) -> None:
        """Spawn node 0's detokenizer. A held runtime's starts at ``release``: it
        needs under a second to import, and before that its imports would take
        CPU from the server's checks and the ranks' imports, both on the way to
        the first token (on two cores, three importing processes slow the two
        that matter)."""
        ctx = mp.get_context("spawn")
        tokenizer_recv, self._detokenizer_tokenizer = ctx.Pipe(duplex=False)
        detokenizer = ctx.Process(
            target=run_child,
            name="detokenizer",
            args=(run_detokenizer_process, tokenizer_recv, self.endpoints, self.args.log_level),
            daemon=True,
        )
        detokenizer.start()
        tokenizer_recv.close()
        self.processes.append(detokenizer)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(reason)`` once, from a thread, when the runtime can no
        longer serve: a child exits while we run, except a replica's while other
        replicas live. Then its group's other processes are stopped and the DP
        controller told (``ReplicaDown``), which ends that replica's requests."""

        def wait() -> None:
            ctx = zmq.Context()
            to_controller = push_socket(ctx, self.endpoints.scheduler) if self.args.dp_size > 1 else None
            live = {p.sentinel: p for p in self.processes}
            group_of = {p.sentinel: g for g in self.groups for p in g.processes}
            up = list(self.groups)
            try:
                while True:
                    ready = cast("list[int]", wait_any(list(live)))  # the sentinels that fired
                    if self._stopping:
                        return
                    reason = self.death_reason([live.pop(s) for s in ready])
                    logger.error("runtime process died: %s", reason)
                    down = [g for g in up if any(group_of.get(s) is g for s in ready)]
                    replicas_only = all(s in group_of for s in ready)
                    if to_controller is None or not replicas_only or len(down) == len(up):
                        on_death(reason)
                        return
                    for group in down:
                        assert group.dp_rank is not None  # a replica: there is a controller
                        up.remove(group)
                        for p in group.processes:
                            live.pop(p.sentinel, None)
                            if p.is_alive():
                                p.terminate()
                        logger.error("%s is down (%s); %d replica(s) serve on", group.name, reason, len(up))
                        to_controller.send_pyobj(ReplicaDown(group.dp_rank, reason))
            finally:
                ctx.destroy(linger=1000)

        threading.Thread(target=wait, daemon=True, name="process-watch").start()

    def death_reason(self, dead: list[BaseProcess]) -> str:
        for p in dead:  # the sentinel fires a moment before the exit code can be read
            p.join(timeout=5)
        return ", ".join(f"{p.name} exited with code {p.exitcode}" for p in dead)

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop every process: on node 0 each group's rank 0 first passes a
        ShutdownRequest to every rank of its group on every node (they leave their
        loops); what is still running after ``grace_s`` is terminated, then killed.
        ``grace_s=0`` where no rank can be in its loop yet (a start-up check failed),
        as for a runtime still held (its ranks end when their pipe closes)."""
        self._stopping = True
        if self.held:
            for hold in self._holds:
                hold.close()
            self._holds, grace_s = [], 0
        if self.leads:
            ctx = zmq.Context()
            try:
                # Held until the ranks have left: a socket collected at once (LINGER 0) would drop the message.
                leaders = [g for g in self.groups if g.processes and g.processes[0].is_alive()]
                sockets = [push_socket(ctx, g.endpoints.scheduler) for g in leaders]
                for sock in sockets:
                    sock.send_pyobj(ShutdownRequest())
                deadline = time.monotonic() + grace_s
                for p in [p for g in leaders for p in g.processes]:
                    p.join(timeout=max(0.0, deadline - time.monotonic()))
            finally:
                ctx.destroy(linger=0)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.endpoints.remove()
        for group in self.groups:
            group.store = None


class SpawnedRuntime(NamedTuple):
    """What ``spawn_runtime`` started: the processes, and the pipes its ranks report on."""

    runtime: RuntimeProcesses
    ready: list[Connection]


def launch_runtime(args: ServerArgs, model_path: str) -> RuntimeProcesses:
    runtime, ready = spawn_runtime(args, model_path)
    wait_until_ready(runtime, ready)
    return runtime


def rank_specs(args: ServerArgs) -> tuple[list[RankSpec | None], Any | None]:
    """This node's ranks of one group (``[None]`` at tp_size 1), and the TCP store
    this process serves for them (None where another node or the launcher serves
    it). One node alone serves it on 127.0.0.1 at a port the OS picks (one store
    per group, so data-parallel groups meet apart)."""
    if args.tp_size == 1:
        return [None], None
    from radixserve.runtime.execution.distributed import RankSpec, Rendezvous, host_store

    store: TCPStore | None
    if args.dist_init_addr is None:
        store = host_store("127.0.0.1", 0, args.dist_timeout)
        host, port = "127.0.0.1", store.port
    else:
        host, port = args.dist_init_host_port
        serve = args.node_rank == 0 and not launcher_serves_store(args, os.environ)
        store = host_store(host, port, args.dist_timeout) if serve else None
    first = args.node_rank * args.ranks_per_node
    specs: list[RankSpec | None] = [
        RankSpec(first + i, args.tp_size, i, Rendezvous(host, port), args.dist_timeout)
        for i in range(args.ranks_per_node)
    ]
    return specs, store


def spawn_group(
    ctx: Any,
    args: ServerArgs,
    model_path: str,
    endpoints: Endpoints,
    dp_rank: int | None,
    plan: ModelPlan | None,
    held: bool = False,
) -> tuple[SchedulerGroup, list[Connection], list[Connection]]:
    """Start this node's ranks of one scheduler group on ``endpoints``, each handed
    ``plan`` (``held``: later, by ``RuntimeProcesses.release``); returns the group
    with the pipes its ranks report on and, ``held``, those they wait on. Replica
    ``dp_rank`` starts at device ``--base-gpu-id + dp_rank * --tp-size``."""
    if dp_rank is not None:
        args = dataclasses.replace(args, base_gpu_id=args.base_gpu_id + dp_rank * args.tp_size)
    specs, store = rank_specs(args)
    group = SchedulerGroup(dp_rank, endpoints, [], store)
    pipes: list[Connection] = []
    holds: list[Connection] = []
    for spec in specs:
        ready_recv, ready_send = ctx.Pipe(duplex=False)
        hold_recv, hold_send = ctx.Pipe(duplex=False) if held else (None, None)
        rank = ctx.Process(
            target=run_child,
            name=scheduler_process_name(spec, dp_rank),
            args=(run_scheduler_process, args, model_path, endpoints, ready_send, spec, dp_rank, plan, hold_recv),
            daemon=True,
        )
        rank.start()
        ready_send.close()
        group.processes.append(rank)
        pipes.append(ready_recv)
        if hold_recv is not None and hold_send is not None:
            hold_recv.close()
            holds.append(hold_send)
    return group, pipes, holds


def spawn_runtime(
    args: ServerArgs,
    model_path: str,
    platform: type[Platform] | None = None,
    held: bool = False,
    plan: ModelPlan | None = None,
) -> SpawnedRuntime:
    """Start this node's processes; returns at once, with the pipes its ranks report on.
    ``platform``: ``--device``'s, where the caller resolved it already. ``held``:
    the ranks wait for ``RuntimeProcesses.release`` before they read the model.
    ``plan``: the model plan node 0's ranks are handed, where the caller made it
    (the start-up checks); else it is made here (held: by ``release``).

    Several model processes on this host share it: each gets the environment the
    platform gives it (``Platform.process_environment``). A lone one needs
    none, so it is spawned without resolving the platform (nor importing torch).

    Call it from a thread that lives as long as the server: the children's
    PR_SET_PDEATHSIG fires when the *thread* that spawned them exits."""
    ctx = mp.get_context("spawn")
    endpoints = Endpoints.fresh()
    tokenizer_path = args.tokenizer_path or model_path
    runtime = RuntimeProcesses(args, model_path, tokenizer_path, endpoints, summary={})
    pipes: list[Connection] = []
    per_host = args.ranks_per_node * args.dp_size
    environment: dict[str, str] = {}
    if per_host > 1 or not held:
        if platform is None:
            from radixserve.registry import get_registry

            platform = get_registry().resolve_platform(args.device)
        environment = platform.process_environment(per_host)
    # Other nodes' ranks take rank 0's plan; held ranks get theirs from release().
    if plan is None and runtime.leads and platform is not None and not held:
        plan = plan_runtime(args, model_path, platform)
    with _environment(environment):
        if args.dp_size == 1:
            spawned = [spawn_group(ctx, args, model_path, endpoints, None, plan, held)]
        else:
            spawned = [
                spawn_group(ctx, args, model_path, endpoints.for_replica(k), k, plan, held) for k in range(args.dp_size)
            ]
    for group, group_pipes, holds in spawned:
        runtime.groups.append(group)
        runtime.processes += group.processes
        pipes += group_pipes
        runtime._holds += holds
    if runtime.leads and args.dp_size > 1:
        controller = ctx.Process(
            target=run_child, name="dp-controller", args=(run_dp_controller_process, args, endpoints), daemon=True
        )
        controller.start()
        runtime.processes.append(controller)
    if runtime.leads and not held:
        runtime.start_detokenizer()
    return SpawnedRuntime(runtime, pipes)


def plan_runtime(args: ServerArgs, model_path: str, platform: type[Platform] | None = None) -> ModelPlan:
    """The model plan every rank (of every replica) is handed; what is wrong with the
    model for these arguments is a StartupError here, before any rank reads it
    (the caller then stops the runtime). ``platform``: ``--device``'s, if resolved already."""
    from radixserve.registry import get_registry
    from radixserve.runtime.execution.model_plan import plan_model

    platform = platform or get_registry().resolve_platform(args.device)
    try:
        return plan_model(args, model_path, platform)
    except (ValueError, OSError, KeyError) as exc:
        raise StartupError(f"{type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in this process's environment while children are spawned (they copy it)."""
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def wait_until_ready(runtime: RuntimeProcesses, ready_pipes: list[Connection]) -> None:
    """Block until every rank of this node has loaded the model (fills
    ``runtime.summary`` from the first and, on node 0, ``runtime.tokenizer``,
    which the detokenizer is sent too); on the first failure stop the processes
    and raise StartupError naming the rank."""
    ranks = runtime.ranks
    pending = dict(zip(ready_pipes, ranks, strict=True))
    statuses: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        if runtime.leads:
            import_tokenizer_modules()  # while the ranks load
        while pending:
            ready = cast("list[Connection]", wait_any(list(pending), timeout=max(0.0, deadline - time.monotonic())))
            if not ready:
                names = ", ".join(p.name for p in pending.values())
                raise StartupError(f"{names} did not start within {STARTUP_TIMEOUT_S} s")
            for conn in ready:
                process = pending.pop(conn)
                try:
                    status: dict[str, Any] | None = conn.recv()
                except EOFError:
                    status = None
                if not status or "error" in status:
                    raise StartupError(_startup_failure(process, status))
                statuses[process.name] = status
        runtime.summary = statuses[ranks[0].name]["summary"]
        if runtime.leads:
            runtime.tokenizer = _share_tokenizer(runtime, statuses[ranks[0].name]["tokenizer"])
    except BaseException:
        runtime.shutdown()
        raise


def _share_tokenizer(runtime: RuntimeProcesses, pickled: bytes) -> Any:
    """Send the first rank's tokenizer to the detokenizer; this process's copy."""
    pipe = runtime._detokenizer_tokenizer
    assert pipe is not None, "spawn_runtime made the pipe"
    try:
        pipe.send_bytes(pickled)
    except OSError:  # the detokenizer is gone
        detokenizer = next(p for p in runtime.processes if p.name == "detokenizer")
        raise StartupError(_startup_failure(detokenizer, None)) from None
    finally:
        pipe.close()
    return pickle.loads(pickled)


def _startup_failure(process: BaseProcess, status: dict[str, Any] | None) -> str:
    if status:
        logger.debug("the %s's traceback:\n%s", process.name, status["error"])
        return f"the {process.name} failed to start: {exception_summary(status['error'])}"
    process.join(timeout=5)
    return f"the {process.name} exited with code {process.exitcode} while starting"
