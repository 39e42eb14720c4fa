"""The conformance kit: it passes the reference backends, agrees with an
independent dense computation, passes the Triton backends in the interpreter,
and fails loudly, naming the cases, on deliberately wrong backends."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from radixserve.kernels import KernelQuery, MoERouting, attention_feature_reasons
from radixserve.registry import PluginRegistry
from radixserve.testing import (
    ATTENTION_CASES,
    GEMM_CASES,
    MOE_CASES,
    QUANT_CASES,
    ConformanceReport,
    check_attention_backend,
    check_gemm_backend,
    check_moe_backend,
    check_quantization_method,
    dense_attention,
    make_attention_inputs,
)
from radixserve_torch.attention import TorchNativeAttention
from radixserve_torch.gemm import TorchGemm
from radixserve_torch.moe import TorchNativeMoE

# --------------------------------------------------------------------------
# The reference passes, and the reference is right


def test_torch_reference_backends_pass_by_name():
    # Every standard case in all three dtypes, but the fused silu_and_mul GEMM cases (torch has no fused kernel).
    fused = sum(c.silu_and_mul for c in GEMM_CASES["standard"])
    for report, cases in (
        (check_attention_backend("torch_native"), len(ATTENTION_CASES["standard"])),
        (check_moe_backend("torch_native"), len(MOE_CASES["standard"])),
        (check_gemm_backend("torch"), len(GEMM_CASES["standard"]) - fused),
        (check_quantization_method("none"), len(QUANT_CASES["standard"])),
        (check_quantization_method("int8"), len(QUANT_CASES["standard"])),
    ):
        report.raise_for_failures(min_run=3 * cases)
        assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}


def test_attention_report_covers_the_contract_cases():
    report = check_attention_backend(TorchNativeAttention, dtypes=[torch.float32])
    cases = [c for c in ATTENTION_CASES["standard"]]
    assert [r.case for r in report.results] == [c.name for c in cases]
    assert {c.page_size for c in cases} == {1, 16}
    assert {c.num_heads // c.num_kv_heads for c in cases} >= {1, 2, 4, 8}
    assert {c.head_dim for c in cases} == {64, 128}
    assert {c.mode for c in cases} == {"extend", "decode"}
    assert any(c.mode == "extend" and any(c.prefix_lens) for c in cases)  # prefix hits
    assert all(r.kv_store == "ok" for r in report.results)
    text = str(report)
    assert "48/48" not in text and "16/16 cases passed" in text and "decode/p16/gqa4/d128" in text


def test_attention_cases_cover_windows_and_soft_capping():
    """Windows shorter and longer than a request's context, in extend (fresh, over
    cached prefixes, a chunk longer than the window after a long prefix) and
    decode (down to one key), on pages of 1 and 16; the cap alone and with a
    window; in every case set."""
    cases = ATTENTION_CASES["standard"]
    windowed = [c for c in cases if c.sliding_window is not None]
    capped = [c for c in cases if c.logit_softcap is not None]
    seq = lambda c: [p + n for p, n in zip(c.prefix_lens, c.extend_lens, strict=False)]  # noqa: E731
    assert any(s > c.sliding_window for c in windowed for s in seq(c))
    assert any(s <= c.sliding_window for c in windowed for s in seq(c))
    extend = [c for c in windowed if c.mode == "extend"]
    assert any(not any(c.prefix_lens) for c in extend)
    assert any(p > c.sliding_window for c in extend for p in c.prefix_lens)  # prefix keys outside the window
    assert any(
        n > c.sliding_window and p > 0 for c in extend for p, n in zip(c.prefix_lens, c.extend_lens, strict=False)
    )
    assert {c.mode for c in windowed} == {c.mode for c in capped} == {"extend", "decode"}
    assert {c.page_size for c in windowed} == {1, 16} and 1 in {c.sliding_window for c in windowed}
    assert any(c.sliding_window is None for c in capped) and any(c.sliding_window for c in capped)
    for name in ("quick", "full"):
        assert {c.mode for c in ATTENTION_CASES[name] if c.sliding_window and c.logit_softcap} == {"extend", "decode"}
    # The query says so, for unsupported_reasons; a windowed case adds a global layer.
    query = capped[-1].query("cpu", torch.float32)
    assert (query.sliding_window, query.logit_softcap) == (capped[-1].sliding_window, capped[-1].logit_softcap)
    inputs = make_attention_inputs(windowed[0], torch.float32)
    assert inputs.layer.sliding_window == windowed[0].sliding_window
    assert inputs.global_layer.sliding_window is None and inputs.global_layer.layer_id == inputs.layer.layer_id + 1
    assert make_attention_inputs(capped[0], torch.float32).global_layer is None


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("case", ATTENTION_CASES["standard"], ids=lambda c: c.name)
def test_torch_native_matches_independent_dense_attention(case, layout):
    """torch_native against a float64 dense computation from the unpaged K/V:
    on a plain contiguous layout and on the kit's permuted pages."""
    inputs = make_attention_inputs(case, torch.float32, layout=layout, seed=11)
    if layout == "contiguous":
        first = inputs.batch.req_to_token[0, : inputs.batch.seq_lens_cpu[0]]
        assert first.tolist() == list(range(case.page_size, case.page_size + len(first)))
    backend = TorchNativeAttention(case.query("cpu", torch.float32))
    backend.init_forward_metadata(inputs.batch)
    for layer in filter(None, (inputs.layer, inputs.global_layer)):
        out = backend.forward(inputs.q, inputs.k, inputs.v, layer, inputs.batch)
        assert (out.double() - dense_attention(inputs, layer)).abs().max().item() < 2e-6


def test_dense_attention_windows_and_cap():
    """The kit's statement itself: a window no shorter than the context is no
    window, a window of one key returns each query's own value, and a cap changes
    the result only through the scores (a huge cap is no cap)."""
    case = next(c for c in ATTENTION_CASES["standard"] if c.name.startswith("extend/window24/prefix"))
    inputs = make_attention_inputs(case, torch.float32, seed=3)
    plain = dense_attention(inputs, inputs.global_layer)
    longest = max(p + n for p, n in zip(case.prefix_lens, case.extend_lens, strict=False))
    wide = dataclasses.replace(inputs.layer, sliding_window=longest)
    assert torch.equal(dense_attention(inputs, wide), plain)
    assert not torch.allclose(dense_attention(inputs), plain)
    own = dataclasses.replace(inputs.layer, sliding_window=1)
    group = case.num_heads // case.num_kv_heads
    new_values = torch.cat([v[p:] for v, p in zip(inputs.values, case.prefix_lens, strict=False)]).double()
    assert torch.allclose(dense_attention(inputs, own), new_values.repeat_interleave(group, dim=1))
    huge = dataclasses.replace(inputs.global_layer, logit_softcap=1e9)
    assert torch.allclose(dense_attention(inputs, huge), plain)
    capped = dataclasses.replace(inputs.global_layer, logit_softcap=1.0)
    assert not torch.allclose(dense_attention(inputs, capped), plain)


def test_paged_layout_is_actually_scattered():
    case = ATTENTION_CASES["standard"][1]  # page 16, prefixes
    inputs = make_attention_inputs(case, torch.float32, seed=0)
    b = inputs.batch
    rows = b.req_to_token[b.req_pool_indices]
    pages = [rows[i, : b.seq_lens_cpu[i]] // case.page_size for i in range(b.batch_size)]
    firsts = [int(p[0]) for p in pages]
    assert firsts != sorted(firsts) or b.req_pool_indices.tolist() != sorted(b.req_pool_indices.tolist())
    assert all(int(p.min()) >= 1 for p in pages)  # page 0 is reserved
    flat = torch.cat([rows[i, : b.seq_lens_cpu[i]] for i in range(b.batch_size)])
    assert flat.unique().numel() == flat.numel()  # no slot shared by two tokens


# --------------------------------------------------------------------------
# Triton in the interpreter (subprocess: TRITON_INTERPRET is read when kernels are defined)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_backends_pass_in_the_interpreter():
    code = textwrap.dedent("""
        import time
        from radixserve.testing import ATTENTION_CASES, MOE_CASES, check_attention_backend, check_moe_backend
        t = time.perf_counter()
        attn = check_attention_backend("triton", device="cpu")
        print(attn)
        print(f"attention kit: {time.perf_counter() - t:.1f}s")
        t = time.perf_counter()
        moe = check_moe_backend("triton", device="cpu")
        print(moe)
        print(f"moe kit: {time.perf_counter() - t:.1f}s")
        attn.raise_for_failures(min_run=3 * len(ATTENTION_CASES["standard"]))
        moe.raise_for_failures(min_run=3 * len(MOE_CASES["standard"]))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]


# --------------------------------------------------------------------------
# Wrong backends fail loudly, naming the cases


class OffByOneKVIndex(TorchNativeAttention):
    """Reads the KV slot of token j+1 for token j (a shifted req_to_token read)."""

    name = "off_by_one"

    def forward_extend(self, q, layer, batch):
        return super().forward_extend(q, layer, _shifted(batch))

    def forward_decode(self, q, layer, batch):
        return super().forward_decode(q, layer, _shifted(batch))


def _shifted(batch):
    return dataclasses.replace(batch, req_to_token=torch.roll(batch.req_to_token, shifts=-1, dims=1))


class WrongSoftmaxScale(TorchNativeAttention):
    """Scales scores by 1/head_dim instead of the layer's scaling."""

    name = "wrong_scale"

    def forward_extend(self, q, layer, batch):
        return super().forward_extend(q, dataclasses.replace(layer, scaling=1.0 / layer.head_dim), batch)

    def forward_decode(self, q, layer, batch):
        return super().forward_decode(q, dataclasses.replace(layer, scaling=1.0 / layer.head_dim), batch)


class StoresIntoLayerZero(TorchNativeAttention):
    """Writes the new K/V into layer 0's buffers whatever the layer."""

    name = "wrong_layer_store"

    def forward(self, q, k, v, layer, batch):
        batch.kv_pool.set_kv(0, batch.out_cache_loc, k, v)
        return (
            self.forward_decode(q, layer, batch)
            if batch.mode.value == "decode"
            else self.forward_extend(q, layer, batch)
        )


class AlwaysRenormalizes(TorchNativeMoE):
    """Renormalizes the top-k weights even when routing says not to."""

    name = "always_renorm"

    def forward(self, hidden, router_logits, w13, w2, routing):
        return super().forward(hidden, router_logits, w13, w2, MoERouting(routing.top_k, True, routing.scoring))


def _assert_fails_naming(report: ConformanceReport, expected_failing: set[str]) -> str:
    assert not report.ok
    failing = {r.case for r in report.failures}
    assert failing == expected_failing, (failing, expected_failing)
    with pytest.raises(AssertionError) as info:
        report.raise_for_failures()
    message = str(info.value)
    for name in expected_failing:
        assert name in message
    assert "FAIL" in str(report)
    return message


def test_off_by_one_kv_index_fails_every_case():
    report = check_attention_backend(OffByOneKVIndex, dtypes=[torch.float32, torch.bfloat16])
    all_cases = {c.name for c in ATTENTION_CASES["standard"]}
    message = _assert_fails_naming(report, all_cases)
    assert "[bfloat16]" in message and "[float32]" in message
    assert all(r.kv_store == "ok" for r in report.results)  # it stores right, reads wrong


class IgnoresTheWindow(TorchNativeAttention):
    name = "no_window"

    def forward(self, q, k, v, layer, batch):
        return super().forward(q, k, v, dataclasses.replace(layer, sliding_window=None), batch)


class IgnoresTheCap(TorchNativeAttention):
    name = "no_cap"

    def forward(self, q, k, v, layer, batch):
        return super().forward(q, k, v, dataclasses.replace(layer, logit_softcap=None), batch)


class OneWindowPerStep(TorchNativeAttention):
    """Applies the first window it sees in a step to every later layer (a per-step
    mask cache keyed on nothing): wrong for a global layer after a windowed one."""

    name = "one_window"

    def init_forward_metadata(self, batch):
        super().init_forward_metadata(batch)
        self._window = None

    def forward(self, q, k, v, layer, batch):
        self._window = self._window or layer.sliding_window
        return super().forward(q, k, v, dataclasses.replace(layer, sliding_window=self._window), batch)


def test_ignoring_the_window_or_the_cap_fails_exactly_those_cases():
    cases = ATTENTION_CASES["standard"]
    # A window no shorter than every request's context changes nothing: only the others can fail.
    longest = lambda c: max(p + n for p, n in zip(c.prefix_lens, c.extend_lens, strict=False))  # noqa: E731
    shorter = {c.name for c in cases if c.sliding_window is not None and c.sliding_window < longest(c)}
    _assert_fails_naming(check_attention_backend(IgnoresTheWindow, dtypes=[torch.float32]), shorter)
    capped = {c.name for c in cases if c.logit_softcap is not None}
    _assert_fails_naming(check_attention_backend(IgnoresTheCap, dtypes=[torch.bfloat16]), capped)
    # The global layer each windowed case runs after its windowed one catches a window kept for the step.
    _assert_fails_naming(check_attention_backend(OneWindowPerStep, dtypes=[torch.float32]), shorter)


def test_backends_without_the_features_skip_their_cases_with_reasons():
    class NoFeatures(TorchNativeAttention):
        name = "no_features"

        @classmethod
        def unsupported_reasons(cls, query):
            return attention_feature_reasons(query, cls.name)

    class WindowOnly(NoFeatures):
        name = "window_only"

        @classmethod
        def unsupported_reasons(cls, query):
            return attention_feature_reasons(query, cls.name, sliding_window=True)

    cases = ATTENTION_CASES["standard"]
    report = check_attention_backend(NoFeatures, dtypes=[torch.float32]).raise_for_failures()
    featured = {c.name for c in cases if c.sliding_window or c.logit_softcap}
    assert {s.case for s in report.skipped} == featured and report.num_run == len(cases) - len(featured)
    text = str(report)
    assert "no_features has no sliding-window attention" in text and "no attention logit soft-capping" in text
    report = check_attention_backend(WindowOnly, dtypes=[torch.float32]).raise_for_failures()
    assert {s.case for s in report.skipped} == {c.name for c in cases if c.logit_softcap}
    assert all(
        s.reasons == ["window_only has no attention logit soft-capping (the model caps its scores)"]
        for s in report.skipped
    )


def test_wrong_softmax_scale_fails_every_case():
    report = check_attention_backend(WrongSoftmaxScale, dtypes=[torch.float16])
    _assert_fails_naming(report, {c.name for c in ATTENTION_CASES["standard"]})


def test_kv_store_into_the_wrong_layer_is_reported():
    report = check_attention_backend(StoresIntoLayerZero, dtypes=[torch.float32], cases="quick")
    _assert_fails_naming(report, {c.name for c in ATTENTION_CASES["quick"]})
    for r in report.results:
        assert "layer 0 K" in r.kv_store and "other slots modified" in r.kv_store
        assert "new slots not stored correctly" in r.kv_store


def test_wrong_moe_renormalization_fails_exactly_the_plain_cases():
    report = check_moe_backend(AlwaysRenormalizes, dtypes=[torch.float32, torch.bfloat16])
    plain = {r.case for r in report.results if "/plain/" in r.case}
    assert plain and len(plain) < len({r.case for r in report.results})
    message = _assert_fails_naming(report, plain)
    assert "E8/k2/plain/T7 [float32]" in message


# --------------------------------------------------------------------------
# Kit behaviour: resolution, dtypes claimed, errors captured


def test_unknown_backend_name_lists_what_is_registered():
    with pytest.raises(LookupError, match=r"no attention backend named 'nope'.*torch_native"):
        check_attention_backend("nope")


def test_backend_resolved_through_a_given_registry():
    from radixserve.hooks import hookimpl

    class Plugin:
        @hookimpl
        def register_gemm_backends(self, register):
            register(DoubleGemm)

    class DoubleGemm(TorchGemm):
        name = "double_gemm"

        def linear(self, x, weight, bias=None):
            return 2 * super().linear(x, weight, bias)

    registry = PluginRegistry()
    registry.register_plugin(Plugin(), "double")
    report = check_gemm_backend("double_gemm", registry=registry, cases="quick")
    assert report.backend == "double_gemm" and not report.ok and len(report.failures) == len(report.results)


class Fp32OnlyGemm(TorchGemm):
    name = "fp32_only"

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return [] if query.dtype == torch.float32 else [f"{query.dtype} is not float32"]


def test_only_claimed_dtypes_run_and_explicit_unclaimed_dtype_fails():
    report = check_gemm_backend(Fp32OnlyGemm, cases="quick")
    assert report.ok and {r.dtype for r in report.results} == {"float32"}
    assert {s.dtype for s in report.skipped} == {"bfloat16", "float16"}
    assert "skipped * [bfloat16]: torch.bfloat16 is not float32" in str(report)
    forced = check_gemm_backend(Fp32OnlyGemm, dtypes=[torch.float16], cases="quick")
    assert not forced.ok and "asked to check float16" in forced.problems[0]


def test_cases_a_backend_rejects_are_skipped_with_reasons():
    class NoHeadDim128(TorchNativeAttention):
        name = "no_d128"

        @classmethod
        def unsupported_reasons(cls, query):
            return ["head_dim 128 is not supported"] if query.head_dim == 128 else []

    report = check_attention_backend(NoHeadDim128, dtypes=[torch.float32])
    skipped = {s.case for s in report.skipped}
    assert report.ok and skipped == {c.name for c in ATTENTION_CASES["standard"] if c.head_dim == 128}
    assert all("/d128" not in r.case for r in report.results) and report.results
    assert "head_dim 128 is not supported" in str(report)
    # Passing what it ran is not passing what it was meant to run.
    every = len(ATTENTION_CASES["standard"])
    assert report.num_run == every - len(skipped)
    assert report.raise_for_failures(min_run=report.num_run) is report
    with pytest.raises(AssertionError, match=rf"{report.num_run} \(case, dtype\) pairs ran, {every} expected"):
        report.raise_for_failures(min_run=every)


def test_backend_supporting_nothing_is_not_ok():
    class Nothing(TorchGemm):
        name = "nothing"

        @classmethod
        def unsupported_reasons(cls, query):
            return ["never"]

    report = check_gemm_backend(Nothing)
    assert not report.ok and not report.results
    with pytest.raises(AssertionError, match="supports none of the dtypes"):
        report.raise_for_failures()


def test_exceptions_and_bad_outputs_become_failing_cases():
    class Crashes(TorchGemm):
        name = "crashes"

        def linear(self, x, weight, bias=None):
            raise RuntimeError("kernel launch failed")

    class WrongDtype(TorchGemm):
        name = "wrong_dtype"

        def linear(self, x, weight, bias=None):
            return super().linear(x, weight, bias).float()

    crash = check_gemm_backend(Crashes, dtypes=[torch.float32], cases="quick")
    assert not crash.ok and all("kernel launch failed" in r.error for r in crash.results)
    wrong = check_gemm_backend(WrongDtype, dtypes=[torch.bfloat16], cases="quick")
    assert not wrong.ok and all("output dtype torch.float32" in r.error for r in wrong.results)


def test_quantization_lifecycle_problems_are_reported():
    from radixserve_torch.quantization import Int8WeightOnly, NoQuantization

    class NoLoader(NoQuantization):
        name = "no_loader"

        def create_weights(self, layer, in_features, out_features, params_dtype, weight_loader):
            super().create_weights(layer, in_features, out_features, params_dtype, weight_loader)
            del layer.weight.weight_loader

    report = check_quantization_method(NoLoader, reference=lambda w, x, b: torch.nn.functional.linear(x, w, b))
    assert not report.ok and "has no weight_loader" in report.results[0].error
    # int8 checked against dense semantics: the quantization error is caught
    lossy = check_quantization_method(
        Int8WeightOnly, dtypes=[torch.float32], reference=lambda w, x, b: torch.nn.functional.linear(x, w, b)
    )
    assert not lossy.ok
    unknown = check_quantization_method(type("Mystery", (NoQuantization,), {"name": "mystery"}))
    assert not unknown.ok and "no reference semantics" in unknown.problems[0]
