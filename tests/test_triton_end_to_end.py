"""Whole-model generation through the Triton backends (CPU interpreter), by the
Engine and by the server, gives the torch reference's greedy tokens, on a dense
and an MoE model.

The scheduler processes are spawned, so setting TRITON_INTERPRET for them is
enough; this pytest process itself never builds a Triton backend."""

from __future__ import annotations

import pytest
from generation_utils import generate, make_scheduler, mixed_prompts

from radixserve import Engine

pytest.importorskip("triton")

# Decode steps cost a launch per kernel per layer in the interpreter, so just enough of them
# that each request's decode crosses into a new 16-token page: the 25- and 41-token prompts'
# 8 decode steps write positions 25..32 and 41..48.
NEW_TOKENS = 9
MODELS = {"dense": dict(arch="llama"), "moe": dict(arch="qwen3_moe")}


@pytest.mark.parametrize("kind,page_size", [("dense", 1), ("moe", 16)])
def test_triton_engine_matches_torch_reference(tiny_model_factory, monkeypatch, kind, page_size):
    model_dir = tiny_model_factory(**MODELS[kind])
    prompts = mixed_prompts(512, [5, 21], seed=31, shared_prefix=20)
    reference = generate(
        make_scheduler(model_dir, page_size=page_size), prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backends = dict(
        attention_backend="triton", elementwise_backend="triton", moe_backend="triton" if kind == "moe" else "auto"
    )
    with Engine(
        model_path=str(model_dir), max_total_tokens=2048, page_size=page_size, log_level="warning", **backends
    ) as engine:
        chosen = engine.server_info()["backends"]
        assert chosen["attention"] == "triton" and chosen["elementwise"] == "triton"
        if kind == "moe":
            assert chosen["moe"] == "triton"
        # A cached prefix: the second prompt shares 20 tokens with the first.
        first = engine.generate(
            input_ids=prompts[0], sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        )
        second = engine.generate(
            input_ids=prompts[1], sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        )
    assert first["output_ids"] == reference[0].output_ids
    assert second["output_ids"] == reference[1].output_ids
    assert second["meta_info"]["cached_tokens"] == 20 // page_size * page_size


def test_triton_server_matches_torch_reference(tiny_model_factory):
    """`radixserve serve --attention-backend triton --moe-backend triton` on the MoE model."""
    import httpx
    from helpers_server import ServerProcess
    from openai import OpenAI
    from transformers import AutoTokenizer

    model_dir = tiny_model_factory(**MODELS["moe"])
    prompts = mixed_prompts(512, [9, 14], seed=32)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    reference = generate(make_scheduler(model_dir), prompts, **params)
    with ServerProcess(
        "--model",
        str(model_dir),
        "--attention-backend",
        "triton",
        "--moe-backend",
        "triton",
        "--max-total-tokens",
        "2048",
        "--skip-server-warmup",
        "--log-level",
        "warning",
        env={"TRITON_INTERPRET": "1"},
    ) as server:
        url = server.wait_ready()
        info = httpx.get(f"{url}/get_server_info", timeout=60).json()
        assert info["backends"]["attention"] == "triton" and info["backends"]["moe"] == "triton"
        native = httpx.post(
            f"{url}/generate", json={"input_ids": prompts[0], "sampling_params": params}, timeout=300
        ).json()
        assert native["output_ids"] == reference[0].output_ids
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        completion = client.completions.create(
            model=str(model_dir),
            prompt=prompts[1],
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert completion.choices[0].text == tokenizer.decode(reference[1].output_ids, skip_special_tokens=True)
