"""Tensor-parallel ranks driven in-process: each rank (a process of a RankPool) runs a
Scheduler on the same scripted load, step by step, and sends back what every
request produced, so the tests compare ranks with each other and with tp=1."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from generation_utils import mixed_prompts
from transformers import AutoTokenizer

from radixserve.config import ServerArgs
from radixserve.messages import GenerateRequest, TokenOutput
from radixserve.runtime.execution.distributed import RankSpec, Rendezvous, host_store
from radixserve.runtime.scheduling.scheduler import Scheduler
from radixserve.sampling.params import SamplingParams

# The load: more requests than may run at once (some wait), prompts sharing a prefix
# (radix cache hits) and longer than a chunk (chunked prefill), aborts of a running
# and of a waiting request, and two sampled requests (one seeded, one not).
SERVER_ARGS = dict(
    dtype="float32",
    max_total_tokens=4096,
    max_running_requests=4,
    chunked_prefill_size=32,
    backend_selection="priority",
)
LENGTHS = [40, 7, 75, 19, 33, 61, 5, 48]
MAX_NEW_TOKENS = 10
ABORTS = {6: ["g0"], 9: ["g7"]}  # step -> rids aborted before it
SAMPLED = {"s0": {"seed": 7}, "s1": {}}


@dataclass
class RequestResult:
    output_ids: list[int]
    logprobs: list[float]
    finish: str


def script(vocab_size: int) -> list[tuple[int, GenerateRequest]]:
    """``(step, request)``: the requests, each added before the step it names."""
    prompts = mixed_prompts(vocab_size, LENGTHS, seed=3, shared_prefix=24)
    greedy = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    plan = [
        (i // 2, GenerateRequest(rid=f"g{i}", input_ids=p, sampling_params=greedy, return_logprob=True))
        for i, p in enumerate(prompts)
    ]
    for j, (rid, extra) in enumerate(SAMPLED.items()):
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, ignore_eos=True, **extra)
        plan.append((1 + j, GenerateRequest(rid=rid, input_ids=prompts[j][:20], sampling_params=params)))
    return plan


def run_script(scheduler: Scheduler, adapters: list[str | None] | None = None) -> dict[str, RequestResult]:
    """``adapters``: the LoRA adapter of each request of the script in turn, cycled (None: none)."""
    plan = script(scheduler.runner.vocab_size)
    if adapters:
        for i, (_, req) in enumerate(plan):
            req.lora_name = adapters[i % len(adapters)]
    outputs: list[TokenOutput] = []
    step = 0
    while plan or scheduler.has_work():
        for rid in ABORTS.get(step, []):
            scheduler.abort(rid)
        for _, req in [item for item in plan if item[0] == step]:
            scheduler.add_request(req)
        plan = [item for item in plan if item[0] > step]
        outputs += scheduler.step() if scheduler.has_work() else scheduler.step_outputs()
        assert scheduler.check_memory(), scheduler.stats()
        step += 1
    results: dict[str, RequestResult] = {}
    for out in outputs:
        r = results.setdefault(out.rid, RequestResult([], [], ""))
        r.output_ids += out.new_token_ids
        r.logprobs += [lp for lp, _ in out.output_token_logprobs]
        if out.finish_reason is not None:
            r.finish = out.finish_reason.type
    return results


def make_args(model_dir: Path, tp_size: int, **more: Any) -> ServerArgs:
    return ServerArgs(model_path=str(model_dir), tp_size=tp_size, **SERVER_ARGS, **more)


def rank_answers(
    model_dirs: list[Path],
    tp_size: int,
    port: int,
    rank: int,
    more: dict[str, Any] | None = None,
    adapters: list[str | None] | None = None,
) -> dict[str, Any]:
    """One rank: for each model, join its group (a key prefix of its own), run the
    script, leave; ``{model_dir: results}``, and ``{"speculation:" + model_dir: (verify
    steps, accepted tokens)}``. ``more``: server arguments besides SERVER_ARGS;
    ``adapters``: run_script's."""
    answers: dict[str, Any] = {}
    for model_dir in model_dirs:
        spec = RankSpec(rank, tp_size, rank, Rendezvous("127.0.0.1", port, prefix=str(model_dir)), 120.0)
        args = make_args(model_dir, tp_size, **(more or {}))
        scheduler = Scheduler(args, str(model_dir), AutoTokenizer.from_pretrained(model_dir), rank=spec)
        answers[str(model_dir)] = run_script(scheduler, adapters)
        stats = scheduler.stats()
        answers[f"speculation:{model_dir}"] = (stats.spec_verify_steps, stats.spec_accepted_tokens_total)
        scheduler.runner.group.destroy()
    return answers


def _serve_jobs(conn: Connection) -> None:
    """A pool process: runs each ``(function, args)`` it is sent and sends back
    ``(True, result)`` or ``(False, traceback)``, until it is sent None."""
    while (job := conn.recv()) is not None:
        function, args = job
        try:
            conn.send((True, function(*args)))
        except BaseException:
            conn.send((False, traceback.format_exc()))


class RankPool:
    """Spawned processes, each the rank of one group at a time, kept from one group to the
    next: a process start (Python with torch, about a second of CPU each) is paid once per
    pool, not once per group.
    Each runs with OMP_NUM_THREADS=1: the ranks share the machine's cores."""

    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read by each child's torch at its import
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        try:
            for _ in range(size):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_serve_jobs, args=(theirs,), daemon=True)
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(mine)
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved

    def start(self, function: Callable[..., Any], args_by_rank: list[tuple[Any, ...]]) -> None:
        """Rank k (process k) runs ``function(*args_by_rank[k])``."""
        for conn, args in zip(self.conns, args_by_rank, strict=False):
            conn.send((function, args))

    def result(self, rank: int, timeout: float) -> Any:
        if not self.conns[rank].poll(timeout):
            raise TimeoutError(f"rank {rank} sent nothing within {timeout} s")
        ok, value = self.conns[rank].recv()
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        return value

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.join()


def run_ranks(
    pool: RankPool,
    model_dirs: list[Path],
    tp_size: int,
    timeout: float = 240,
    adapters: list[str | None] | None = None,
    **more: Any,
) -> list[dict[str, Any]]:
    """Every rank's ``{model_dir: results}``, rank by rank: the pool's first ``tp_size`` processes."""
    store = host_store("127.0.0.1", 0, timeout)
    jobs = [(model_dirs, tp_size, store.port, rank, more, adapters) for rank in range(tp_size)]
    pool.start(rank_answers, jobs)
    return [pool.result(rank, timeout) for rank in range(tp_size)]
