"""Gemma 2 and Gemma 3 (text): greedy generation through the scheduler equals HF
transformers `generate` token for token, with logprobs within 1e-3 (fp32), on
tiny random-weight models whose sliding window (16) is shorter than every
prompt + output; the radix cache on (hits longer than the window) and off,
chunked prefill, 16-token pages, and the torch_native attention forced. In bfloat16, the
teacher-forced greedy choices agree with HF's own bfloat16 run (threshold in
docs/architecture.md, "Models"). Plus the pieces: the Gemma ops of the torch
reference are HF's arithmetic bit for bit, the model's facts steer selection,
and unsupported configs are refused."""

from __future__ import annotations

import importlib.util
import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from generation_utils import generate, hf_greedy, make_scheduler, mixed_prompts, run, run_in_triton_interpreter, submit
from transformers import AutoConfig, AutoModelForCausalLM

from radixserve.backend_timing import timing_cases
from radixserve.checkpoints.loader import model_facts, model_kernel_query, model_timing_shapes
from radixserve.kernels import KernelQuery, elementwise_op_reasons
from radixserve.layers.context import ModelContext
from radixserve.messages import FinishReason
from radixserve.models import Gemma2ForCausalLM
from radixserve.models.gemma2 import GEMMA_ELEMENTWISE_OPS as GEMMA_OPS
from radixserve.registry import get_registry
from radixserve.testing.tiny_models import tiny_config
from radixserve_torch.elementwise import TorchNativeElementwise

NEW_TOKENS = 64
WINDOW = 16
CHUNK = 8
BF16_AGREEMENT = 0.97  # teacher-forced greedy agreement with HF's bfloat16 run (docs/architecture.md)

ARCHITECTURES = {
    # Layers alternate sliding/full (HF's default layer_types); the attention cap
    # is low enough that the scores reach into the tanh's bend; logits capped at 30.
    "gemma2": dict(arch="gemma2", num_layers=3, sliding_window=WINDOW, attn_logit_softcapping=2.0),
    # Two local layers (rope theta 10k) and a global one (1M, linear scaling x4), q/k norms.
    "gemma3": dict(
        arch="gemma3_text",
        num_layers=3,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    ),
}
# Tied embeddings, as Gemma's; an LM head (= embedding) scale this small keeps the
# scaled embedding from swamping the residual stream, which otherwise makes greedy
# decoding repeat one token. Top-2 logit gaps along HF's greedy paths stay above 1e-3.
COMMON = dict(tie_word_embeddings=True, lm_head_scale=0.05, weight_scale=0.2)
BF16_MODEL = dict(hidden_size=96, head_dim=24, intermediate_size=192, seed=5)

CONFIGS = {
    "default": {},  # radix cache on: the repeated prompt and the shared prefix are hits longer than the window
    "cache-off": {"disable_radix_cache": True},
    "chunked-prefill": {"chunked_prefill_size": CHUNK},
    "page-16": {"page_size": 16},  # the cache hits whole pages: 16 of the shared 24 tokens
    "torch-native": {"attention_backend": "torch_native"},
}


@dataclass
class Reference:
    name: str
    model_dir: Path
    prompts: list[list[int]]
    hf: list[tuple[list[int], list[float]]]  # HF's greedy tokens and their logprobs, NEW_TOKENS a prompt


def gemma_prompts(vocab_size: int) -> list[list[int]]:
    """Prompts of 7 to 40 tokens, the last sharing its first 24 tokens with the
    first: a cache hit longer than the window."""
    prompts = mixed_prompts(vocab_size, [30, 40, 7, 21, 12], seed=5)
    return prompts[:4] + [prompts[0][:24] + prompts[4]]


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def reference(request: pytest.FixtureRequest, tiny_model_factory) -> Reference:
    model_dir = tiny_model_factory(**ARCHITECTURES[request.param], **COMMON, seed=4)
    prompts = gemma_prompts(AutoConfig.from_pretrained(model_dir).vocab_size)
    return Reference(request.param, model_dir, prompts, [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts])


def _generate(scheduler, prompts: list[list[int]]) -> list:
    return generate(scheduler, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprob=True)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_hf(reference: Reference, config: str):
    server_args = CONFIGS[config]
    scheduler = make_scheduler(reference.model_dir, **server_args)
    prompts = reference.prompts
    assert all(len(p) + NEW_TOKENS > WINDOW for p in prompts)
    # One prompt alone, then the ragged batch with it again (a cache hit where the cache is on).
    alone = _generate(scheduler, prompts[:1])
    batch = _generate(scheduler, prompts)
    assert alone[0].output_ids == batch[0].output_ids
    for prompt, result, (ref_ids, ref_logprobs) in zip(prompts, batch, reference.hf, strict=False):
        assert result.output_ids == ref_ids, f"{config}: prompt of {len(prompt)} tokens"
        assert result.finish_reason == FinishReason("length")
        worst = max(abs(a - b) for a, b in zip(result.logprobs, ref_logprobs, strict=False))
        assert worst < 1e-3, f"{config}: chosen-token logprob differs from HF by {worst}"
    if "disable_radix_cache" in server_args:
        assert all(r.cached_tokens == 0 for r in batch)
    else:
        # The repeated prompt and the one sharing 24 tokens with it hit the cache, as far as the window or beyond.
        page = server_args.get("page_size", 1)
        assert batch[0].cached_tokens >= WINDOW and batch[4].cached_tokens == 24 // page * page
    if "chunked_prefill_size" in server_args:
        for prompt, result in zip(prompts, batch, strict=False):
            assert result.first_token_step >= math.ceil((len(prompt) - result.cached_tokens) / CHUNK)


TRITON_NEW_TOKENS = 6  # HF's first 6 greedy tokens of its 64: every step past the window already
# Both architectures in one interpreter process: {name: [model dir, prompts]} -> {name: result}.
TRITON_RUN = textwrap.dedent("""
    import json, sys
    from generation_utils import generate, make_scheduler
    out = {}
    for name, (model_dir, prompts) in json.loads(sys.argv[1]).items():
        scheduler = make_scheduler(model_dir, attention_backend="triton", elementwise_backend="triton")
        results = generate(scheduler, prompts, max_new_tokens=int(sys.argv[2]), ignore_eos=True)
        out[name] = {"tokens": [r.output_ids for r in results], "backends": scheduler.runner.backends}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def triton_runs(tiny_model_factory) -> dict[str, dict]:
    """Every architecture's first two prompts through the Triton kernels, in one
    interpreter subprocess (one start for both)."""
    jobs = {}
    for name, arch in ARCHITECTURES.items():
        model_dir = tiny_model_factory(**arch, **COMMON, seed=4)  # the ``reference`` fixture's model
        jobs[name] = [str(model_dir), gemma_prompts(AutoConfig.from_pretrained(model_dir).vocab_size)[:2]]
    return run_in_triton_interpreter(TRITON_RUN, json.dumps(jobs), str(TRITON_NEW_TOKENS))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_in_the_interpreter_generates_hf_tokens(reference: Reference, triton_runs: dict[str, dict]):
    """Windows, caps and Gemma's norms and GELU, all through the Triton kernels."""
    out = triton_runs[reference.name]
    assert all(len(p) > WINDOW for p in reference.prompts[:2])  # two prompts past the window
    assert (out["backends"]["attention"], out["backends"]["elementwise"]) == ("triton", "triton")
    assert out["tokens"] == [tokens[:TRITON_NEW_TOKENS] for tokens, _ in reference.hf[:2]]


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def bf16_reference(request: pytest.FixtureRequest, tiny_model_factory) -> Reference:
    """A model of its own for bfloat16, whose sqrt(hidden_size) = 9.798 is not a
    bfloat16 number (HF rounds it to 9.8125); its logit margins are small enough
    that bfloat16 rounding flips some greedy choices."""
    model_dir = tiny_model_factory(**ARCHITECTURES[request.param], **COMMON, **BF16_MODEL)
    prompts = gemma_prompts(AutoConfig.from_pretrained(model_dir).vocab_size)
    return Reference(request.param, model_dir, prompts, [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts])


def test_bf16_teacher_forced_greedy_agrees_with_hf(bf16_reference: Reference, capsys):
    """Along HF's fp32 greedy continuations, fed whole to both in bfloat16: how
    often is our top-1 token HF's bfloat16 top-1 (and how often is each the fp32
    choice)? Ours runs through the scheduler, HF in one forward."""
    ref = bf16_reference
    scheduler = make_scheduler(ref.model_dir, dtype="bfloat16")
    rids = [
        submit(
            scheduler,
            prompt + ids,
            return_logprob=True,
            logprob_start_len=len(prompt),
            top_logprobs_num=1,
            max_new_tokens=1,
        )
        for prompt, (ids, _) in zip(ref.prompts, ref.hf, strict=False)
    ]
    results = run(scheduler)
    hf = AutoModelForCausalLM.from_pretrained(ref.model_dir, dtype=torch.bfloat16).eval()
    same = ours_fp32 = hf_fp32 = total = 0
    for prompt, (ids, _), rid in zip(ref.prompts, ref.hf, rids, strict=False):
        ours = [top[0][1] for top in results[rid].input_top_logprobs]
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        assert len(ours) == len(theirs) == len(ids)
        same += sum(a == b for a, b in zip(ours, theirs, strict=False))
        ours_fp32 += sum(a == b for a, b in zip(ours, ids, strict=False))
        hf_fp32 += sum(a == b for a, b in zip(theirs, ids, strict=False))
        total += len(ids)
    with capsys.disabled():
        print(
            f"\n{ref.name}: bf16 teacher-forced top-1, ours vs HF bf16 {same}/{total} = {same / total:.1%}"
            f" (the fp32 token: ours {ours_fp32 / total:.1%}, HF bf16 {hf_fp32 / total:.1%})"
        )
    assert same / total >= BF16_AGREEMENT


# ---- the pieces ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_reference_gemma_ops_are_bitwise_hf(dtype):
    from transformers.activations import ACT2FN
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    gen = torch.Generator().manual_seed(0)
    ops = TorchNativeElementwise(KernelQuery(device="cpu", dtype=dtype, elementwise_ops=GEMMA_OPS))
    hf_norm = Gemma2RMSNorm(96, eps=1e-6).to(dtype)
    hf_norm.weight.data = (0.5 * torch.randn(96, generator=gen)).to(dtype)
    x, residual = (torch.randn((9, 96), generator=gen) * 3).to(dtype), torch.randn((9, 96), generator=gen).to(dtype)
    expected_residual = residual + x
    out, new_residual = ops.gemma_rms_norm(x.clone(), hf_norm.weight.data, 1e-6, residual.clone())
    assert torch.equal(out, hf_norm(expected_residual)) and torch.equal(new_residual, expected_residual)
    # Per head on a strided view of a fused QKV output (Gemma 3's q/k norms): the input stays as it was.
    qkv = torch.randn((5, 6 * 96), generator=gen).to(dtype)
    q = qkv[:, : 4 * 96].view(5, 4, 96)
    before = qkv.clone()
    assert torch.equal(ops.gemma_rms_norm(q, hf_norm.weight.data, 1e-6), hf_norm(q.clone()))
    assert torch.equal(qkv, before)

    gate_up = (torch.randn((3, 2 * 40), generator=gen) * 3).to(dtype)
    expected = ACT2FN["gelu_pytorch_tanh"](gate_up[:, :40]) * gate_up[:, 40:]
    assert torch.equal(ops.gelu_tanh_and_mul(gate_up), expected)


def test_facts_name_the_window_the_cap_and_the_ops():
    registry = get_registry()
    gemma2 = tiny_config("gemma2", num_layers=3, sliding_window=WINDOW, attn_logit_softcapping=2.0)
    gemma2.architectures = ["Gemma2ForCausalLM"]
    facts = model_facts(gemma2)
    assert (facts.sliding_window, facts.logit_softcap, facts.elementwise_ops) == (WINDOW, 2.0, GEMMA_OPS)
    # HF's Gemma 3 attention caps nothing, whatever the config says.
    gemma3 = tiny_config("gemma3_text", sliding_window=WINDOW, attn_logit_softcapping=50.0)
    gemma3.architectures = ["Gemma3ForCausalLM"]
    facts = model_facts(gemma3)
    assert (facts.sliding_window, facts.logit_softcap, facts.elementwise_ops) == (WINDOW, None, GEMMA_OPS)

    # An elementwise backend without the Gemma ops refuses the model by name; triton has them.
    query = model_kernel_query(gemma2, "cuda", torch.bfloat16)
    assert query.elementwise_ops == GEMMA_OPS and query.logit_softcap == 2.0
    assert elementwise_op_reasons(query, "plain") == [f"plain has no {op} (the model calls it)" for op in GEMMA_OPS]
    assert registry.forced("elementwise", query, "triton").name == "triton"
    assert registry.select("elementwise", query).name == "triton"
    # auto times the candidates on the ops the model calls
    shapes = model_timing_shapes(gemma2, query, tp_size=1, decode_rows=4, prefill_rows=32, context_length=256)
    labels = [case.label.split("/")[0] for case in timing_cases("elementwise", query, shapes, torch.device("cpu"))]
    assert sorted(set(labels)) == ["gelu_tanh_and_mul", "gemma_rms_norm", "rotary"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ],
)
def test_configs_computed_otherwise_are_refused(overrides, message):
    ctx = ModelContext.create(get_registry(), KernelQuery(device="cpu", dtype=torch.float32), torch.device("cpu"))
    with pytest.raises(NotImplementedError, match=message):
        Gemma2ForCausalLM(tiny_config("gemma2", **overrides), ctx)
