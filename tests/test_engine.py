"""The offline Engine API over the real processes: results shape, batching,
streaming, sampling controls, bad input, n>1, and int8 quantization."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from generation_utils import generate, hf_greedy, make_scheduler, mixed_prompts, run, submit
from helpers_pool import EnginePool, assert_whole_pool_back
from safetensors.torch import load_file, save_file

from radixserve import Engine
from radixserve_torch.quantization import dequantize_int8, quantize_int8_per_channel

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def test_generate_one_and_batch_match_hf(engine, tiny_llama_dir):
    prompts = mixed_prompts(512, [6, 19, 2], seed=21)
    one = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert isinstance(one, dict)
    assert set(one) >= {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == 6 and meta["completion_tokens"] == 24
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    batch = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, result in zip(prompts, batch, strict=False):
        assert result["output_ids"] == hf_greedy(tiny_llama_dir, prompt, 24)[0]
    assert batch[0]["output_ids"] == one["output_ids"]
    assert one["text"] == engine.tokenizer.decode(one["output_ids"])


def test_text_prompts_and_per_prompt_params(engine):
    results = engine.generate(["hello world", "the fox"], [{"max_new_tokens": 3}, {"max_new_tokens": 5}])
    assert [r["meta_info"]["completion_tokens"] for r in results] == [3, 5]
    assert results[0]["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("hello world"))


def test_stream_concatenates_to_full_result(engine):
    params = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
    full = engine.generate("streaming test", params)
    chunks = list(engine.generate("streaming test", params, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_repeated_prompt_hits_the_cache(engine):
    prompt = mixed_prompts(512, [33], seed=22)[0]
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2})
    again = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2})
    assert again["meta_info"]["cached_tokens"] == 32


def test_seed_reproducible_and_top_k_1_is_greedy(engine):
    sampled = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = engine.generate("seed test", {**sampled, "seed": 7})
    b = engine.generate("seed test", {**sampled, "seed": 7})
    c = engine.generate("seed test", {**sampled, "seed": 8})
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]
    greedy = engine.generate("seed test", {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})
    top1 = engine.generate("seed test", {**sampled, "top_k": 1})
    assert top1["output_ids"] == greedy["output_ids"]


def test_stop_string_excluded_and_reported(engine):
    greedy = engine.generate("stop here", {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True})
    text = greedy["text"]
    # A short ASCII piece of the greedy text, not at its very start.
    match = next(m for m in re.finditer(r"[a-z]{2,}", text) if m.start() > 0)
    stop = match.group()
    result = engine.generate(
        "stop here", {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}
    )
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert result["text"] == text[: text.index(stop)]
    assert stop not in result["text"]


def test_stop_token_ids_and_logit_bias(engine):
    greedy = engine.generate("bias", {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True})
    target = greedy["output_ids"][4]
    stopped = engine.generate("bias", {"max_new_tokens": 10, "temperature": 0.0, "stop_token_ids": [target]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert stopped["output_ids"][-1] == target
    forced = engine.generate("bias", {"max_new_tokens": 5, "temperature": 0.0, "logit_bias": {"77": 100.0}})
    assert forced["output_ids"] == [77] * 5
    banned = engine.generate(
        "bias",
        {
            "max_new_tokens": 10,
            "temperature": 0.0,
            "ignore_eos": True,
            "logit_bias": {str(t): -100.0 for t in set(greedy["output_ids"])},
        },
    )
    assert not set(banned["output_ids"]) & set(greedy["output_ids"])


def test_penalties_reduce_repetition(engine):
    base = {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}
    plain = engine.generate("repeat repeat repeat", base)["output_ids"]
    penalized = engine.generate("repeat repeat repeat", {**base, "presence_penalty": 2.0, "frequency_penalty": 2.0})[
        "output_ids"
    ]
    assert len(set(plain)) < len(plain), "the random model is expected to repeat itself"
    assert len(set(penalized)) > len(set(plain))
    rep = engine.generate("repeat repeat repeat", {**base, "repetition_penalty": 2.0})["output_ids"]
    assert len(set(rep)) > len(set(plain))


def test_n_greater_than_one_shares_the_prompt(engine):
    prompt = mixed_prompts(512, [21], seed=23)[0]
    results = engine.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 8, "n": 3, "temperature": 1.0, "seed": 1}
    )
    assert isinstance(results, list) and len(results) == 3
    assert [r["index"] for r in results] == [0, 1, 2]
    assert len({tuple(r["output_ids"]) for r in results}) > 1
    # A cold prompt: the request itself got nothing from the cache ...
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in results)
    # ... but its three choices all ran on the prompt KV prefilled once.
    before = engine.server_info()["stats"]["cached_tokens_total"]
    again = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2, "n": 3})
    after = engine.server_info()["stats"]["cached_tokens_total"]
    assert all(r["meta_info"]["cached_tokens"] == len(prompt) - 1 for r in again)
    assert after - before == 4 * (len(prompt) - 1)  # the warm-up and the three choices


def test_logprobs_through_engine(engine, tiny_llama_dir):
    prompt = mixed_prompts(512, [9], seed=24)[0]
    result = engine.generate(
        input_ids=prompt, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3, logprob_start_len=0
    )
    meta = result["meta_info"]
    _, ref = hf_greedy(tiny_llama_dir, prompt, 24)
    assert max(abs(lp - r) for (lp, _), r in zip(meta["output_token_logprobs"], ref, strict=False)) < 1e-3
    for (lp, token), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=False):
        assert len(top) == 3 and top[0][1] == token and abs(top[0][0] - lp) < 1e-6  # greedy: chosen is top-1
        assert top[0][0] >= top[1][0] >= top[2][0]
    assert [t for _, t in meta["input_token_logprobs"]] == prompt
    assert meta["input_token_logprobs"][0][0] is None


BAD_INPUTS = [
    (dict(prompt=""), "text"),
    (dict(prompt="hi", sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
    (dict(prompt="hi", sampling_params={"temperature": -0.5}), "temperature"),
    (dict(prompt="hi", sampling_params={"top_p": 0.0}), "top_p"),
    (dict(prompt="hi", sampling_params={"top_p": 1.5}), "top_p"),
    (dict(prompt="hi", sampling_params={"bogus": 1}), "bogus"),
    (dict(input_ids=list(range(20, 520)) * 3), "input_ids"),
    (dict(input_ids=[5, 6], sampling_params={"max_new_tokens": 1023}), "max_new_tokens"),
    (dict(prompt="hi", sampling_params={"regex": "[a-", "max_new_tokens": 4}), "regex"),
    (dict(prompt="hi", sampling_params={"regex": "a+", "json_schema": "{}"}), "sampling_params.json_schema"),
]


@pytest.mark.parametrize("kwargs,field", BAD_INPUTS, ids=[f for _, f in BAD_INPUTS])
def test_bad_input_raises_naming_the_field_and_engine_keeps_serving(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)
    assert engine.generate("still alive", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_structured_output_through_the_engine(engine):
    """SGLang's Engine takes json_schema / regex / ebnf in sampling_params; the babbling
    tiny model's outputs then parse, match and derive, batched and streamed."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    params = [
        {"json_schema": json.dumps(schema), "max_new_tokens": 200, "temperature": 1.0, "seed": 1},
        {"regex": "(yes|no)-[0-9]{3}", "max_new_tokens": 16, "temperature": 1.0, "seed": 2},
        {"ebnf": 'root ::= "a" "b"+', "max_new_tokens": 6, "temperature": 1.0, "seed": 3},
        {"max_new_tokens": 8, "temperature": 1.0, "seed": 4},
    ]
    outs = engine.generate(["x", "y", "z", "w"], params)
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "stop", outs[0]
    assert 0 <= json.loads(outs[0]["text"])["n"] <= 99
    assert re.fullmatch("(yes|no)-[0-9]{3}", outs[1]["text"]), outs[1]["text"]
    assert re.fullmatch("ab+", outs[2]["text"]), outs[2]["text"]
    assert outs[3]["meta_info"]["completion_tokens"] == 8
    streamed = "".join(c["text"] for c in engine.generate("y", params[1], stream=True))
    assert streamed == outs[1]["text"]


def test_the_whole_pool_is_back_after_everything(engine):
    assert_whole_pool_back(EnginePool(engine))


def test_int8_weight_only_matches_dequantized_reference(tiny_model_factory, tmp_path, capsys):
    model_dir = tiny_model_factory(arch="llama", seed=5)
    # The reference: the same checkpoint with every quantized weight replaced by
    # its int8 round trip, run unquantized.
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(model_dir, ref_dir)
    weights = load_file(ref_dir / "model.safetensors")
    for name, w in weights.items():
        if re.search(r"_proj\.weight$", name):
            q, scale = quantize_int8_per_channel(w)
            weights[name] = dequantize_int8(q, scale, w.dtype)
    save_file(weights, ref_dir / "model.safetensors", metadata={"format": "pt"})

    prompts = mixed_prompts(512, [8, 30, 15], seed=25)
    params = dict(max_new_tokens=48, ignore_eos=True, return_logprob=True)
    int8_scheduler = make_scheduler(model_dir, quantization="int8", backend_selection="priority")
    int8 = generate(int8_scheduler, prompts, **params)
    # The same kernels as the int8 run, named (whatever picked them).
    chosen = int8_scheduler.runner.backends
    same_kernels = {f"{kind}_backend": chosen[kind] for kind in ("attention", "gemm", "elementwise")}
    ref = generate(make_scheduler(ref_dir, **same_kernels), prompts, **params)
    fp32 = generate(make_scheduler(model_dir), prompts, **params)
    assert [r.output_ids for r in int8] == [r.output_ids for r in ref]
    assert [r.logprobs for r in int8] == [r.logprobs for r in ref]
    # Closeness to fp32, teacher-forced: along each fp32 greedy continuation,
    # how often is the int8 model's top-1 token the fp32 model's choice?
    scheduler = make_scheduler(model_dir, quantization="int8", backend_selection="priority")
    same = total = 0
    for prompt, full in zip(prompts, fp32, strict=False):
        rid = submit(
            scheduler,
            prompt + full.output_ids,
            return_logprob=True,
            logprob_start_len=len(prompt),
            top_logprobs_num=1,
            max_new_tokens=1,
        )
        tops = run(scheduler)[rid].input_top_logprobs
        same += sum(top[0][1] == token for top, token in zip(tops, full.output_ids, strict=False))
        total += len(full.output_ids)
    with capsys.disabled():
        print(f"\nint8 vs fp32 teacher-forced greedy agreement: {same}/{total} = {same / total:.1%}")
    assert same / total > 0.9


def test_request_larger_than_the_kv_pool_is_rejected_up_front(tiny_llama_dir):
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=64, log_level="warning") as small:
        with pytest.raises(ValueError, match=r"max_new_tokens: .* needs 80 KV cache slots; the pool holds 64"):
            small.generate(input_ids=list(range(20, 40)), sampling_params={"max_new_tokens": 60})
        with pytest.raises(ValueError, match=r"input_ids: .*the pool holds 64"):
            small.generate(input_ids=list(range(20, 90)), sampling_params={"max_new_tokens": 1})
        ok = small.generate(input_ids=list(range(20, 40)), sampling_params={"max_new_tokens": 44})
        assert ok["meta_info"]["finish_reason"]["type"] in ("length", "stop")
