"""The scheduler survives any single request: messages that skipped the front
door's validation, a tokenizer that fails on one request, and a failed model
step. Each bad request ends alone with an error; the others finish with the
tokens they get on their own, and the KV pool invariant holds throughout."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from generation_utils import FailingDecode, generate, make_scheduler, mixed_prompts, run
from helpers_pool import SchedulerPool, assert_whole_pool_back

from radixserve.messages import GenerateRequest
from radixserve.runtime.execution.batch import BatchPlan
from radixserve.runtime.scheduling.scheduler import Scheduler
from radixserve.sampling.params import SamplingParams

GOOD_TOKENS = 6


def _scheduler(model_dir: Path, **server_args: Any) -> Scheduler:
    """An in-process scheduler with the highest-priority backends: nothing here tests `auto`, and every
    scheduler of the module (page size 1 or 4) runs the same kernels as the one that made ``alone``."""
    return make_scheduler(model_dir, backend_selection="priority", **server_args)


@dataclass
class Hostile:
    """A GenerateRequest built field by field, so that fields may have any type."""

    input_ids: Any = field(default_factory=lambda: [5, 6, 7, 8])
    params: dict = field(default_factory=dict)
    sampling_params: Any = None

    def message(self, rid: str) -> GenerateRequest:
        params = self.sampling_params
        if params is None:
            params = SamplingParams(max_new_tokens=4)
            for key, value in self.params.items():  # no __post_init__ normalisation: raw values
                object.__setattr__(params, key, value)
        return GenerateRequest(rid=rid, input_ids=self.input_ids, sampling_params=params)


HOSTILE = {
    "lone surrogate stop": Hostile(params={"stop": ["\udc00"]}),
    "stop not a list": Hostile(params={"stop": 123}),
    "stop of non-strings": Hostile(params={"stop": [1, 2]}),
    "empty stop string": Hostile(params={"stop": [""]}),
    "token id out of range": Hostile(input_ids=[5, 10**9]),
    "negative token id": Hostile(input_ids=[-1, 5]),
    "bool token id": Hostile(input_ids=[True, False]),
    "string token id": Hostile(input_ids=["a", "b"]),
    "float token id": Hostile(input_ids=[1.5]),
    "input_ids not a list": Hostile(input_ids=7),
    "input_ids None": Hostile(input_ids=None),
    "empty prompt": Hostile(input_ids=[]),
    "temperature a string": Hostile(params={"temperature": "hot"}),
    "temperature NaN": Hostile(params={"temperature": float("nan")}),
    "top_p out of range": Hostile(params={"top_p": 5.0}),
    "top_k zero": Hostile(params={"top_k": 0}),
    "negative max_new_tokens": Hostile(params={"max_new_tokens": -1}),
    "max_new_tokens beyond context": Hostile(params={"max_new_tokens": 10**9}),
    "max_new_tokens a float": Hostile(params={"max_new_tokens": 2.5}),
    "logit_bias bad key": Hostile(params={"logit_bias": {"abc": 1.0}}),
    "logit_bias huge": Hostile(params={"logit_bias": {5: 1e39}}),
    "stop_token_ids out of range": Hostile(params={"stop_token_ids": [10**9]}),
    "repetition_penalty zero": Hostile(params={"repetition_penalty": 0.0}),
    "sampling_params not a SamplingParams": Hostile(sampling_params="not params"),
    "temperature None": Hostile(params={"temperature": None}),
}


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir):
    return mixed_prompts(512, [5, 9, 14], seed=3)


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, prompts) -> list[list[int]]:
    scheduler = _scheduler(tiny_llama_dir)
    return [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=GOOD_TOKENS, ignore_eos=True)]


def _submit_good(scheduler, prompts, first: int = 0) -> list[str]:
    rids = []
    for i, prompt in enumerate(prompts, start=first):
        rid = f"good{i}"
        scheduler.add_request(
            GenerateRequest(
                rid=rid,
                input_ids=prompt,
                sampling_params=SamplingParams(max_new_tokens=GOOD_TOKENS, temperature=0.0, ignore_eos=True),
            )
        )
        rids.append(rid)
    return rids


def test_hostile_messages_are_refused_alone(tiny_llama_dir, prompts, alone):
    scheduler = _scheduler(tiny_llama_dir)
    good = _submit_good(scheduler, prompts[:2])
    for name, hostile in HOSTILE.items():
        scheduler.add_request(hostile.message(name))
    good += _submit_good(scheduler, prompts[2:], first=2)
    results = run(scheduler)
    for name in HOSTILE:
        finish = results[name].finish_reason
        assert finish.type == "abort" and finish.status_code == 400, (name, finish)
        assert finish.message, name
        assert results[name].output_ids == [], name
    assert [results[r].output_ids for r in good] == alone
    assert_whole_pool_back(SchedulerPool(scheduler))


def test_a_failing_stop_check_ends_only_its_request(tiny_llama_dir, prompts, alone):
    scheduler = _scheduler(tiny_llama_dir)
    poison = alone[0][0]  # the first token the first prompt produces
    scheduler.stop_checker.tokenizer = FailingDecode(scheduler.stop_checker.tokenizer, poison)
    scheduler.add_request(
        GenerateRequest(
            rid="victim",
            input_ids=prompts[0],
            sampling_params=SamplingParams(
                max_new_tokens=GOOD_TOKENS, temperature=0.0, ignore_eos=True, stop=["never in the text"]
            ),
        )
    )
    good = _submit_good(scheduler, prompts)
    results = run(scheduler)
    finish = results["victim"].finish_reason
    assert finish.type == "abort" and finish.status_code == 500 and "tokenizer failure" in finish.message
    assert [results[r].output_ids for r in good] == alone
    assert_whole_pool_back(SchedulerPool(scheduler))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("failing_step", [0, 3], ids=["extend", "decode"])
def test_a_failed_step_ends_its_batch_and_the_scheduler_goes_on(tiny_llama_dir, prompts, alone, failing_step, overlap):
    scheduler = _scheduler(tiny_llama_dir, page_size=4, disable_overlap_schedule=not overlap)
    forward = scheduler.runner.forward
    calls = {"n": 0}

    def fails_once(batch):  # a kernel error in one step, injected
        calls["n"] += 1
        if calls["n"] == failing_step + 1:
            raise RuntimeError("kernel failure")
        return forward(batch)

    scheduler.runner.forward = fails_once
    first = _submit_good(scheduler, prompts)
    results = run(scheduler)
    failed = [r for r in first if results[r].finish_reason.type == "abort"]
    assert failed == first, "every request of the failed batch ends with the error"
    assert all("kernel failure" in results[r].finish_reason.message for r in failed)
    assert all(results[r].finish_reason.status_code == 500 for r in failed)
    stats = scheduler.stats()
    assert stats.memory_invariant_ok and stats.private_tokens == 0
    # Nothing half-written was cached: the same prompts now give the tokens they give alone.
    again = [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=GOOD_TOKENS, ignore_eos=True)]
    assert again == alone
    assert_whole_pool_back(SchedulerPool(scheduler))


def test_a_failure_while_planning_unpins_and_the_scheduler_goes_on(tiny_llama_dir, prompts, alone):
    """The planner pins each candidate's cached prefix before weighing it; a failure
    after a pin (here: admitting the second request) must not leave the lock behind."""
    scheduler = _scheduler(tiny_llama_dir, page_size=4)
    generate(scheduler, prompts, max_new_tokens=GOOD_TOKENS, ignore_eos=True)  # their prefixes are cached now
    admit, calls = scheduler.ledger.admit, {"n": 0}

    def fails_on_second(req, match):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("admission failure")
        admit(req, match)

    scheduler.ledger.admit = fails_on_second
    first = _submit_good(scheduler, prompts)
    results = run(scheduler)
    assert results[first[0]].finish_reason.status_code == 500
    assert "admission failure" in results[first[0]].finish_reason.message
    stats = scheduler.stats()
    assert stats.memory_invariant_ok and stats.locked_cached_tokens == 0, stats.memory_error
    scheduler.ledger.admit = admit
    again = [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=GOOD_TOKENS, ignore_eos=True)]
    assert again == alone


@pytest.mark.parametrize("failing_launch", [0, 3], ids=["extend", "decode"])
def test_a_failure_between_allocating_and_launching_frees_exactly_the_new_slots(
    tiny_llama_dir, prompts, alone, failing_launch, monkeypatch
):
    """The step's slots are allocated, then the batch is built on the device; a
    failure in between (a device out of memory while building the batch, say) must
    free exactly the slots of that step. The token-table rows were used before
    (their old entries name slots that others own now), and the pages are 4 wide,
    so a decode step's slot often lies on a page the request holds already."""
    scheduler = _scheduler(tiny_llama_dir, page_size=4)
    generate(scheduler, prompts, max_new_tokens=GOOD_TOKENS, ignore_eos=True)  # rows and pages used once
    launch, calls = BatchPlan.launch, {"n": 0}

    def fails_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == failing_launch + 1:
            raise RuntimeError("device out of memory")
        return launch(*args, **kwargs)

    monkeypatch.setattr(BatchPlan, "launch", fails_once)
    first = _submit_good(scheduler, prompts)
    results = run(scheduler)
    assert {results[r].finish_reason.status_code for r in first} >= {500}
    stats = scheduler.stats()
    assert stats.memory_invariant_ok and stats.private_tokens == 0, stats.memory_error
    monkeypatch.setattr(BatchPlan, "launch", launch)
    again = [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=GOOD_TOKENS, ignore_eos=True)]
    assert again == alone
    assert_whole_pool_back(SchedulerPool(scheduler))
