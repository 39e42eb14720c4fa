"""Multi-LoRA serving (docs/lora.md): each adapter's greedy tokens are HF
transformers + PEFT's on the same base and adapter (fp32); a batch mixing four
adapters and the base gives each request its tokens alone, also when the
adapters outnumber the device slots; prefixes are cached per adapter and never
shared across adapters; unloading under traffic lets running requests finish,
refuses new ones and leaves the KV pool whole; what cannot be served is refused
naming the field; a real server serves adapters by OpenAI ``model`` and SGLang's
``lora_path``, lists them, and loads and unloads them behind the admin key."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from generation_utils import make_scheduler, mixed_prompts, run
from helpers_lora import build_adapters, lora_paths, peft_greedy
from helpers_server import serving
from safetensors.torch import load_file, save_file

from radixserve.checkpoints.lora import AdapterError, AdapterWeights
from radixserve.checkpoints.random_adapter import build_random_adapter
from radixserve.config import ServerArgs
from radixserve.messages import GenerateRequest
from radixserve.sampling.params import SamplingParams
from radixserve_torch import cpu_kernels

NEW_TOKENS = 8
F32 = {"dtype": "float32", "backend_selection": "priority"}
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    return build_adapters(tiny_llama_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    return mixed_prompts(vocab, [9, 23, 14], seed=5)


def submit(scheduler, prompt: list[int], adapter: str | None, rid: str, max_new_tokens: int = NEW_TOKENS) -> str:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    scheduler.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling_params=params, lora_name=adapter))
    return rid


def lora_scheduler(model_dir: Path, adapters: dict[str, Path], **more):
    return make_scheduler(model_dir, enable_lora=True, lora_paths=lora_paths(adapters), **F32, **more)


def test_each_adapter_alone_matches_peft(tiny_llama_dir, adapters, prompts):
    scheduler = lora_scheduler(tiny_llama_dir, adapters)
    for name in [None, *adapters]:
        rid = submit(scheduler, prompts[0], name, f"alone-{name}")
        got = run(scheduler)[rid].output_ids
        assert got == peft_greedy(tiny_llama_dir, adapters.get(name or ""), prompts[0], NEW_TOKENS), name


NEEDS_CPU_KERNELS = pytest.mark.skipif(bool(cpu_kernels.unavailable_reasons()), reason="the C++ kernels cannot build")


@pytest.mark.parametrize(
    "backend,slots",
    [
        ("torch_grouped", 8),
        ("torch_native", 2),
        pytest.param("cpu_sgmv", 4, marks=NEEDS_CPU_KERNELS),
    ],
)
def test_a_batch_mixing_adapters_gives_each_request_its_tokens_alone(tiny_llama_dir, adapters, prompts, backend, slots):
    """Every prompt under every adapter and the base, all at once (ragged lengths, so
    prefill and decode runs interleave adapters); with two slots for four adapters the
    scheduler admits by slots and adapters take turns in them."""
    names = [None, *adapters]
    alone = lora_scheduler(tiny_llama_dir, adapters, lora_backend=backend)
    expected = {}
    for i, prompt in enumerate(prompts):
        for name in names:
            rid = submit(alone, prompt, name, f"{i}-{name}")
            expected[rid] = run(alone)[rid].output_ids
    mixed = lora_scheduler(tiny_llama_dir, adapters, lora_backend=backend, max_loras_per_batch=slots)
    for i, prompt in enumerate(prompts):
        for name in names:
            submit(mixed, prompt, name, f"{i}-{name}")
    got = run(mixed)
    assert {rid: r.output_ids for rid, r in got.items()} == expected
    distinct = {tuple(tokens) for tokens in expected.values()}
    assert len(distinct) == len(expected), "every adapter changes every prompt's tokens"


def test_prefixes_are_cached_per_adapter(tiny_llama_dir, adapters, prompts):
    scheduler = lora_scheduler(tiny_llama_dir, adapters)
    prompt = prompts[1]
    cached = {}
    for step, name in enumerate(["all8", "all8", "qv4", None, "qv4"]):
        rid = submit(scheduler, prompt, name, f"c{step}")
        cached[step] = run(scheduler)[rid].cached_tokens
    assert cached[0] == 0 and cached[1] == len(prompt) - 1  # the same adapter: all but the last token
    assert cached[2] == 0 and cached[3] == 0  # another adapter, the base: nothing of all8's
    assert cached[4] == len(prompt) - 1


def test_unloading_under_traffic_lets_running_requests_finish(tiny_llama_dir, adapters, prompts):
    scheduler = lora_scheduler(tiny_llama_dir, adapters)
    early = [submit(scheduler, p, "all8", f"u{i}", max_new_tokens=12) for i, p in enumerate(prompts)]
    base = submit(scheduler, prompts[0], None, "base", max_new_tokens=12)
    outputs = scheduler.step() + scheduler.step()
    assert scheduler.unload_lora_adapter("all8") == {"success": True}
    late = submit(scheduler, prompts[0], "all8", "late")
    results = run(scheduler, earlier=outputs)
    for rid in [*early, base]:
        assert results[rid].finish_reason.type == "length" and len(results[rid].output_ids) == 12
    assert results[late].finish_reason.status_code == 400 and "lora_path" in results[late].finish_reason.message
    assert scheduler.check_memory()
    # Its cached KV went with it: only the base request's prefix is left in the cache.
    assert scheduler.ledger.cache.total_size() == len(prompts[0]) + 12 - 1
    # Loaded again under the same name: a new load, which reuses nothing of the old one's KV.
    assert scheduler.load_lora_adapter("all8", str(adapters["all8"]))["success"]
    again = submit(scheduler, prompts[0], "all8", "again", max_new_tokens=12)
    result = run(scheduler)[again]
    assert result.cached_tokens == 0 and result.output_ids == results[early[0]].output_ids
    assert scheduler.flush_cache() and scheduler.check_memory()


def test_an_adapter_kept_from_the_slots_gets_one_though_others_keep_arriving(tiny_llama_dir, adapters, prompts):
    """One device slot, requests of one adapter arriving every step: a request of another
    adapter never finds the slot free, until it has waited ``slot_wait_limit``; then only
    its adapter's and base requests are admitted, the busy adapter drains, and it runs
    while that adapter's requests still arrive. The KV pool stays whole throughout."""
    busy, other = list(adapters)[:2]
    scheduler = lora_scheduler(tiny_llama_dir, adapters, max_loras_per_batch=1)
    scheduler.planner.slot_wait_limit = float("inf")  # as before the rule: no request ever counts as starved
    submit(scheduler, prompts[0], busy, "busy-0", max_new_tokens=4)
    outputs = scheduler.step()
    submit(scheduler, prompts[1], other, "other", max_new_tokens=4)
    arrivals = 0

    def steps(n: int) -> None:
        nonlocal arrivals, outputs
        for _ in range(n):
            arrivals += 1
            submit(scheduler, prompts[arrivals % len(prompts)], busy, f"busy-{arrivals}", max_new_tokens=4)
            outputs += scheduler.step()
            assert scheduler.check_memory()

    steps(24)
    assert not any(o.rid == "other" and o.new_token_ids for o in outputs)  # starved
    scheduler.planner.slot_wait_limit = 0.0  # it has waited longer than that
    steps(12)
    assert any(o.rid == "other" and o.finish_reason is not None for o in outputs)
    results = run(scheduler, earlier=outputs)
    assert results["other"].output_ids and all(len(r.output_ids) == 4 for r in results.values())


def test_what_cannot_be_served_is_refused_naming_the_field(tiny_llama_dir, adapters, tmp_path):
    scheduler = lora_scheduler(tiny_llama_dir, {"all8": adapters["all8"]}, max_lora_rank=8, max_loaded_loras=2)
    refusals = {
        "rank": scheduler.load_lora_adapter("big", str(adapters["mlp16"])),
        "taken": scheduler.load_lora_adapter("all8", str(adapters["qv4"])),
        "missing": scheduler.load_lora_adapter("x", str(tmp_path / "nowhere")),
    }
    assert refusals["rank"] == {"error": "adapter rank 16 is above --max-lora-rank 8", "field": "lora_path"}
    assert refusals["taken"]["field"] == "lora_name" and "loaded already" in refusals["taken"]["error"]
    assert refusals["missing"]["field"] == "lora_path" and "adapter_config.json" in refusals["missing"]["error"]
    # A module the model does not have (a renamed projection), and one LoRA does not serve.
    odd = build_random_adapter(tiny_llama_dir, tmp_path / "odd", rank=4, target_modules=("q_proj",))
    weights = odd / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file({k.replace("self_attn.q_proj", "self_attn.qq_proj"): v for k, v in tensors.items()}, str(weights))
    refused = scheduler.load_lora_adapter("odd", str(odd))
    assert refused["field"] == "lora_path" and "qq_proj" in refused["error"] and "not served" in refused["error"]
    assert scheduler.load_lora_adapter("qv4", str(adapters["qv4"]))["success"]
    full = scheduler.load_lora_adapter("kv8", str(adapters["kv8"]))
    assert full["field"] == "lora_name" and "--max-loaded-loras is 2" in full["error"]
    # An adapter the server does not hold, and a request for one while LoRA is off.
    rid = submit(scheduler, [5, 6, 7], "nope", "nope")
    assert run(scheduler)[rid].finish_reason.status_code == 400
    plain = make_scheduler(tiny_llama_dir, **F32)
    rid = submit(plain, [5, 6, 7], "all8", "off")
    assert "--enable-lora" in run(plain)[rid].finish_reason.message


def test_peft_features_that_are_not_served_are_refused(tiny_llama_dir, adapters, tmp_path):
    for key, value, words in [
        ("use_dora", True, "DoRA"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("bias", "lora_only", "biases"),
    ]:
        target = tmp_path / key
        build_random_adapter(tiny_llama_dir, target, rank=4, target_modules=("q_proj",))
        config = json.loads((target / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(AdapterError, match=words) as info:
            AdapterWeights.read(str(target), torch.float32)
        assert info.value.field == "lora_path"


def test_lora_flags_are_checked():
    with pytest.raises(ValueError, match="lora_paths: each entry is NAME=PATH"):
        ServerArgs(enable_lora=True, lora_paths=["noequals"])
    with pytest.raises(ValueError, match="lora_paths: needs --enable-lora"):
        ServerArgs(lora_paths=["a=/x"])
    with pytest.raises(ValueError, match="lora_paths: adapter name 'm:x' is the served model's name or has a ':'"):
        ServerArgs(enable_lora=True, lora_paths=["m:x=/x"])
    with pytest.raises(ValueError, match="max_loras_per_batch: must be >= 1"):
        ServerArgs(enable_lora=True, max_loras_per_batch=0)
    assert ServerArgs(enable_lora=True, lora_paths=["a=/x", "b=/y=z"]).lora_adapters() == {"a": "/x", "b": "/y=z"}


ADMIN = "admin-key"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters):
    with serving(
        tiny_llama_dir,
        "--enable-lora",
        "--lora-paths",
        f"all8={adapters['all8']}",
        "--dtype",
        "float32",
        "--max-lora-rank",
        "8",
        "--admin-api-key",
        ADMIN,
        "--backend-selection",
        "priority",
    ) as proc:
        yield proc


def test_server_serves_adapters_by_model_and_lora_path(server, tiny_llama_dir, adapters, prompts):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    (base,) = [name for name, card in models.items() if card.parent is None]
    assert models["all8"].parent == base and models["all8"].root == str(adapters["all8"])
    assert client.models.retrieve("all8").parent == base and client.models.retrieve(base).parent is None
    expected = peft_greedy(tiny_llama_dir, adapters["all8"], prompts[0], NEW_TOKENS)
    out = client.completions.create(model="all8", prompt=prompts[0], max_tokens=NEW_TOKENS, temperature=0)
    assert out.model == "all8"
    native = httpx.post(
        f"{server.url}/generate",
        json={"input_ids": prompts[0], "lora_path": "all8", "sampling_params": GREEDY},
    ).json()
    assert native["output_ids"] == expected
    assert out.choices[0].text == native["text"]
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="qv4", prompt=prompts[0], max_tokens=2)
    assert info.value.body["param"] == "model"


def test_server_loads_and_unloads_behind_the_admin_key(server, adapters, prompts):
    base = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    body = {"lora_name": "qv4", "lora_path": str(adapters["qv4"])}
    assert httpx.post(f"{server.url}/load_lora_adapter", json=body).status_code == 401
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=admin)
    assert loaded.status_code == 200 and loaded.json()["loaded_adapters"]["qv4"] == str(adapters["qv4"])
    too_big = httpx.post(
        f"{server.url}/load_lora_adapter",
        json={"lora_name": "m", "lora_path": str(adapters["mlp16"])},
        headers=admin,
    )
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "lora_path"
    for name in (base, "a:b"):  # a request could not name it apart from the base model
        clash = httpx.post(f"{server.url}/load_lora_adapter", json={**body, "lora_name": name}, headers=admin)
        assert clash.status_code == 400 and clash.json()["error"]["param"] == "lora_name"
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": f"{base}:qv4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert chat.status_code == 200 and chat.json()["model"] == f"{base}:qv4"
    assert httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "qv4"}, headers=admin).status_code == 200
    gone = httpx.post(
        f"{server.url}/generate", json={"input_ids": prompts[0], "lora_path": "qv4", "sampling_params": {}}
    )
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "lora_path"
    info = httpx.get(f"{server.url}/server_info").json()
    assert [a["name"] for a in info["lora"]["adapters"]] == ["all8"]
    assert info["stats"]["memory_invariant_ok"]
