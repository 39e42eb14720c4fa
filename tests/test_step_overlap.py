"""The step path that never waits for the device (radixserve/transfer.py,
runtime/execution/batch.py, runtime/execution/model_worker.py): launch order with overlap
scheduling, results read only when digested, and KV pages freed while the
device may still compute, through a transfer whose copies land only when the
test says so (the CPU has no asynchronous copies to wait for)."""

from __future__ import annotations

import pytest
import torch
from generation_utils import generate, make_scheduler, mixed_prompts, run, submit
from helpers_cache import alloc_tokens

from radixserve.cache.memory_pool import PagedAllocator
from radixserve.transfer import HostCopy, HostTransfer


class _Landing:
    """An event that has passed once the test lets it."""

    def __init__(self):
        self.passed = False

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.passed = True  # waiting on a real event lets the device finish


class DelayedTransfer(HostTransfer):
    """Host copies that land only when ``land()`` is called or someone waits for them,
    as on a device that is still computing the work queued before them."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.landings: list[_Landing] = []

    def to_host(self, *tensors: torch.Tensor) -> HostCopy:
        landing = _Landing()
        self.landings.append(landing)
        return HostCopy([t.clone() for t in tensors], landing)

    def land(self) -> None:
        for landing in self.landings:
            landing.passed = True


def test_copies_on_the_cpu_are_plain_and_ready():
    transfer = HostTransfer(torch.device("cpu"))
    t = transfer.to_device([3, 1, 2])
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    assert transfer.to_device([0.5], torch.float32).dtype == torch.float32
    copy = transfer.to_host(t, t * 2)
    assert copy.ready()
    assert [x.tolist() for x in copy.wait()] == [[3, 1, 2], [6, 2, 4]]


def test_pages_freed_in_flight_are_not_handed_out_until_their_ids_land():
    transfer = DelayedTransfer()
    alloc = PagedAllocator(num_pages=4, page_size=4, device=torch.device("cpu"), transfer=transfer)
    first = alloc_tokens(alloc, 8)  # pages 1-2
    assert alloc.available_size() == 8
    alloc.free(first)
    # The slot ids are still on their way: the pages are not free yet.
    assert alloc.available_size() == 8
    other = alloc_tokens(alloc, 8)  # pages 3-4, not the freed ones
    assert set((other // 4).tolist()) == {3, 4}
    transfer.land()
    assert alloc.available_size() == 8
    assert set((alloc_tokens(alloc, 8) // 4).tolist()) == {1, 2}


def test_allocation_waits_for_frees_in_flight_when_short():
    transfer = DelayedTransfer()
    alloc = PagedAllocator(num_pages=2, page_size=4, device=torch.device("cpu"), transfer=transfer)
    alloc.free(alloc_tokens(alloc, 8))
    assert alloc.available_size() == 0
    assert alloc.available_size(wait=True) == 8  # an exact count waits
    alloc.free(alloc_tokens(alloc, 8))
    # Short of pages with a free in flight: waits for it rather than failing.
    assert alloc.alloc_slots([0], [-1], [8]) is not None


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_next_step_is_launched_before_the_previous_one_is_awaited(tiny_llama_dir, overlap):
    scheduler = make_scheduler(tiny_llama_dir, disable_overlap_schedule=not overlap)
    events: list[tuple[str, int]] = []
    launch = scheduler.worker.launch

    def recording_launch(work):
        index = sum(1 for kind, _ in events if kind == "launch")
        events.append(("launch", index))
        future = launch(work)
        pending = future.result()  # the step is queued; its tokens are not read yet
        wait = pending.wait

        def recording_wait():
            events.append(("wait", index))
            return wait()

        pending.wait = recording_wait
        return future

    scheduler.worker.launch = recording_launch
    prompt = mixed_prompts(512, [7], seed=3)[0]
    results = run_one(scheduler, prompt, max_new_tokens=5)
    assert len(results) == 5
    launches = [i for kind, i in events if kind == "launch"]
    # A prefill step, then four decode steps; with overlap a fifth, launched before the
    # finish was digested (its token is dropped).
    assert launches == list(range(6 if overlap else 5))
    for i in launches[1:]:
        position = events.index(("launch", i))
        if overlap:
            # Step i is queued while step i - 1 is still unread.
            assert ("wait", i - 1) not in events[:position]
        else:
            assert events[position - 1] == ("wait", i - 1)


def run_one(scheduler, prompt: list[int], **params) -> list[int]:
    rid = submit(scheduler, prompt, temperature=0.0, ignore_eos=True, **params)
    return run(scheduler)[rid].output_ids


def test_rows_of_finished_requests_wait_for_the_steps_that_may_still_use_them(tiny_llama_dir):
    # Many short requests through few rows: a finished request still runs in the
    # step launched before its finish was digested, so its row is reused only
    # after that step; outputs match the run without overlap.
    prompts = mixed_prompts(512, [5, 9, 3, 12, 7, 4, 10, 6], seed=21)
    expected = [
        r.output_ids
        for r in generate(
            make_scheduler(tiny_llama_dir, disable_overlap_schedule=True), prompts, max_new_tokens=6, ignore_eos=True
        )
    ]
    scheduler = make_scheduler(tiny_llama_dir, disable_overlap_schedule=False, max_running_requests=2)
    got = [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=6, ignore_eos=True)]
    assert got == expected
    assert scheduler.check_memory() and not scheduler.ledger.holders()  # every token table row came back
