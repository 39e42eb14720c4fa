"""hardware/npu (radixserve-plugin-npu) without an NPU: it installs and loads, says
why it cannot run here and never falls back to the CPU; the logic that needs no
hardware (block tables, sequence lengths, padding, visibility parsing, pool
sizing, routes) against hand-checked values; and its attention and MoE paths run
on the CPU through tests/npu_standin.py, a torch emulation of the documented
torch_npu operators, passing the conformance kit against the torch reference and
generating what torch_native does through the in-process scheduler."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import replace

import pytest
import torch
from generation_utils import generate, make_scheduler, mixed_prompts
from helpers_platform import installed_plugins_report
from npu_standin import StandInDevice, StandInError, StandInTorchNpu, install
from test_cli_startup import assert_short_failure, run_cli

from radixserve.cache.memory_pool import KVLayout, KVPool
from radixserve.forward_batch import ForwardMode
from radixserve.hooks import hookimpl
from radixserve.kernels import KernelQuery
from radixserve.registry import PluginError, PluginRegistry
from radixserve.runtime.execution.model_runner import kv_pool_tokens
from radixserve.testing import ATTENTION_CASES, MOE_CASES, check_attention_backend, check_moe_backend
from radixserve.testing.conformance import AttentionCase, make_attention_inputs
from radixserve_npu.attention import NpuFusedAttention, build_block_table, build_padding_index, choose_route
from radixserve_npu.moe import NpuGroupedMoE
from radixserve_npu.platform import TORCH_NPU_MISSING, NpuPlatform, parse_visible_devices

needs_no_torch_npu = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here"
)


class CpuNpuAttention(NpuFusedAttention):
    """The plugin's attention, allowed on the cpu device so the kit can run it
    there against the stand-in operator."""

    devices = ("npu", "cpu")


class CpuNpuMoE(NpuGroupedMoE):
    devices = ("npu", "cpu")


# -- installation and start-up ------------------------------------------------


def test_distribution_installs_with_its_entry_point_and_no_vendor_dependency():
    dist = importlib.metadata.distribution("radixserve-plugin-npu")
    eps = [ep for ep in dist.entry_points if ep.group == "radixserve"]
    assert [(ep.name, ep.value) for ep in eps] == [("npu", "radixserve_npu")]
    assert dist.requires == ["radixserve"]  # torch_npu is the user's CANN-matched install
    registry = PluginRegistry()
    assert registry.candidates["platform"]["npu"].plugin == "npu"  # collects the registrations
    info = registry.plugins["npu"]
    assert info.error is None
    assert info.registered == {"platform": ["npu"], "attention": ["npu_fused"], "moe": ["npu_grouped"]}


@needs_no_torch_npu
def test_plugins_json_lists_npu_unusable_with_the_reason():
    backends = installed_plugins_report()["backends"]
    npu = next(p for p in backends["platform"] if p["name"] == "npu")
    assert npu["usable"] is False and npu["reasons"] == [TORCH_NPU_MISSING]
    assert {"npu_fused"} <= {a["name"] for a in backends["attention"] if not a["usable"]}
    assert {"npu_grouped"} <= {m["name"] for m in backends["moe"] if not m["usable"]}


@needs_no_torch_npu
def test_serve_on_npu_exits_with_the_reason_and_never_runs_on_cpu(tiny_model_factory):
    code, output = run_cli("serve", "--device", "npu", "--model", str(tiny_model_factory()), "--port", "0")
    assert_short_failure(code, output, "--device 'npu'", "is not usable here", TORCH_NPU_MISSING)
    with pytest.raises(PluginError, match="torch_npu is not installed"):
        PluginRegistry().resolve_platform("npu")


# -- platform ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("", []),
        ("  ", []),
        ("0", [0]),
        ("0,1,3", [0, 1, 3]),
        (" 4 , 2 ", [4, 2]),
    ],
)
def test_visible_devices_parsing(value, expected):
    assert parse_visible_devices(value) == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("0,,1", "'' is not a device id"),
        ("1,a", "'a' is not a device id"),
        ("-1", "'-1' is not a device id"),
        ("2,2", "device 2 is listed twice"),
    ],
)
def test_visible_devices_malformed_values_name_the_variable(value, message):
    with pytest.raises(ValueError, match=f"ASCEND_RT_VISIBLE_DEVICES={value!r}: {message}"):
        parse_visible_devices(value)


@pytest.fixture
def torch_npu_found(monkeypatch):
    """find_spec('torch_npu') succeeds (the stand-in answers for the module)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "torch_npu" else real(name, *a)
    )
    return install(monkeypatch)


def test_platform_reasons_through_torch_npu(torch_npu_found, monkeypatch):
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    assert NpuPlatform.unavailable_reasons() == []
    torch_npu_found.npu.count = 0
    assert NpuPlatform.unavailable_reasons() == [
        "no Ascend NPU is visible (check the driver with npu-smi info, and ASCEND_RT_VISIBLE_DEVICES)"
    ]
    torch_npu_found.npu.count = 2
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    assert NpuPlatform.unavailable_reasons() == ["ASCEND_RT_VISIBLE_DEVICES is set but empty, so no NPU is visible"]
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,x")
    assert "'x' is not a device id" in NpuPlatform.unavailable_reasons()[0]
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "6,7")
    assert NpuPlatform.unavailable_reasons() == []
    assert NpuPlatform().describe(1) == "npu:1 Ascend910B-standin (64 GiB, physical device 7)"
    assert (NpuPlatform.dist_backend, NpuPlatform.default_dtype) == ("hccl", torch.bfloat16)


def test_platform_reports_a_torch_npu_that_fails_to_load(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "torch_npu" else real(name, *a)
    )
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    import radixserve_npu.ops

    def broken():
        raise ImportError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(radixserve_npu.ops, "load_torch_npu", broken)
    assert NpuPlatform.unavailable_reasons() == [
        "torch_npu failed to load: ImportError: libhccl.so: cannot open shared object file"
    ]


def test_kv_pool_sizing_from_reported_memory(monkeypatch):
    gib = 2**30
    per_token = 128 * 1024  # 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes
    # 0.85 x 64 GiB - 16 GiB of weights = 38.4 GiB < 0.9 x 60 GiB free: 38.4 GiB / 128 KiB = 314572.8
    assert kv_pool_tokens(64 * gib, 60 * gib, 16 * gib, 0.85, per_token, 10**9) == 314572
    # Little free memory (another process holds the rest): 0.9 x 20 GiB / 128 KiB
    assert kv_pool_tokens(64 * gib, 20 * gib, 16 * gib, 0.85, per_token, 10**9) == 147456
    assert kv_pool_tokens(64 * gib, 60 * gib, 16 * gib, 0.85, per_token, 4096) == 4096  # running x context cap
    assert kv_pool_tokens(16 * gib, 16 * gib, 20 * gib, 0.85, per_token, 4096) == 0  # weights exceed the share
    # The same rule fed by what the NPU platform reports through torch_npu.npu.mem_get_info.
    standin = install(monkeypatch, StandInTorchNpu(npu=StandInDevice(free_bytes=20 * gib, total_bytes=64 * gib)))
    platform = NpuPlatform()
    assert (platform.total_memory_bytes(), platform.available_memory_bytes()) == (64 * gib, 20 * gib)
    assert (
        kv_pool_tokens(
            platform.total_memory_bytes(),
            platform.available_memory_bytes(),
            16 * gib,
            platform.default_mem_fraction,
            per_token,
            10**9,
        )
        == 147456
    )
    assert standin.calls == []  # memory queries are not operator calls


# -- metadata, by hand ---------------------------------------------------------


def test_block_table_from_the_slot_table():
    ps = 4
    req_to_token = torch.full((4, 12), 99, dtype=torch.int64)  # 99: garbage past each request's tokens
    req_to_token[2, :5] = torch.tensor([12, 13, 14, 15, 28])  # pages 3, 7
    req_to_token[0, :9] = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23, 36])  # pages 2, 5, 9
    req_to_token[3, :1] = torch.tensor([24])  # page 6
    table = build_block_table(req_to_token, torch.tensor([2, 0, 3]), torch.tensor([5, 9, 1]), [5, 9, 1], ps)
    assert table.dtype == torch.int32
    assert table.tolist() == [[3, 7, 0], [2, 5, 9], [6, 0, 0]]


def test_padding_index_and_sequence_lengths():
    index, longest = build_padding_index([2, 3, 1], torch.device("cpu"))
    assert longest == 3 and index.tolist() == [0, 1, 3, 4, 5, 6]
    index, longest = build_padding_index([1, 1, 1, 1], torch.device("cpu"))
    assert longest == 1 and index.tolist() == [0, 1, 2, 3]


def test_metadata_from_a_forward_batch():
    case = AttentionCase("x", "extend", 128, 4, 2, 64, prefix_lens=(128, 0), extend_lens=(5, 130))
    inputs = make_attention_inputs(case, torch.bfloat16, seed=3)
    batch = inputs.batch
    backend = CpuNpuAttention(case.query("cpu", torch.bfloat16))
    backend.init_forward_metadata(batch)
    meta = batch.attn_metadata
    assert meta.route == "fused"
    assert meta.seq_lens == [133, 130] and meta.extend_lens == [5, 130] and meta.max_extend == 130
    # Both requests span two pages: the pages of their slots at positions 0 and 128.
    pages = [(batch.req_to_token[batch.req_pool_indices[i], [0, 128]] // 128).tolist() for i in range(2)]
    assert meta.block_table.tolist() == pages and meta.block_table.dtype == torch.int32
    assert meta.pad_index.tolist() == list(range(5)) + list(range(130, 260))


@pytest.mark.parametrize(
    "mode, longest, ps, route",
    [
        (ForwardMode.DECODE, 1, 16, "fused"),
        (ForwardMode.EXTEND, 1, 16, "fused"),
        (ForwardMode.EXTEND, 7, 128, "fused"),
        (ForwardMode.EXTEND, 7, 512, "fused"),
        (ForwardMode.EXTEND, 7, 16, "reference"),
        (ForwardMode.EXTEND, 7, 64, "reference"),
        (ForwardMode.EXTEND, 7, 1024, "reference"),
    ],
)
def test_route_per_step(mode, longest, ps, route):
    assert choose_route(mode, longest, ps) == route


def test_unsupported_shapes_name_the_operator_limit():
    ok = KernelQuery(device="npu", dtype=torch.bfloat16, head_dim=128, num_heads=32, num_kv_heads=8, page_size=128)
    assert NpuFusedAttention.unsupported_reasons(ok) == []
    assert NpuFusedAttention.unsupported_reasons(replace(ok, device="cpu")) == [
        "runs on the npu platform only, not cpu"
    ]
    reasons = NpuFusedAttention.unsupported_reasons(replace(ok, dtype=torch.float32, head_dim=72, page_size=1))
    assert len(reasons) == 3 and "float16 and bfloat16" in reasons[0]
    assert "head_dim 72" in reasons[1] and "page size 1 is not a multiple of 16" in reasons[2]
    assert (
        "65 query heads per KV head"
        in NpuFusedAttention.unsupported_reasons(replace(ok, num_heads=65, num_kv_heads=1))[-1]
    )
    assert NpuGroupedMoE.unsupported_reasons(
        KernelQuery(device="npu", dtype=torch.bfloat16, num_experts=2048, top_k=8)
    ) == ["2048 experts: npu_grouped_matmul takes at most 1024 groups"]


# -- the attention path through the stand-in operator ---------------------------


# Page size 128: several-token prefill takes the operator too (the standard
# cases' page sizes 1 and 16 do not: 1 is rejected, 16 routes extend to torch).
PREFILL_CASES = [
    AttentionCase("extend/prefix/p128/gqa4/d64", "extend", 128, 8, 2, 64, (128, 0, 37), (20, 150, 9)),
    AttentionCase("extend/nocache/p128/gqa1/d128", "extend", 128, 4, 4, 128, (0, 0), (1, 40), scaling=0.07),
    AttentionCase("extend/one-each/p128/gqa2/d64", "extend", 128, 4, 2, 64, (300, 5), (1, 1)),
    AttentionCase("decode/p128/gqa8/d64", "decode", 128, 8, 1, 64, (129, 0, 255), (1, 1, 1)),
]


def test_attention_kit_through_the_standin(monkeypatch):
    standin = install(monkeypatch)
    report = check_attention_backend(CpuNpuAttention, device="cpu")
    print(report)
    # bfloat16 and float16, every standard case but those on 1-token pages and those with a
    # sliding window or a logit cap (npu_fused has neither: it says so).
    featured = {c.name for c in ATTENTION_CASES["standard"] if c.sliding_window or c.logit_softcap}
    plain = [c for c in ATTENTION_CASES["standard"] if c.name not in featured]
    report.raise_for_failures(min_run=2 * sum(c.page_size > 1 for c in plain))
    assert featured <= {s.case for s in report.skipped}
    assert "npu_fused has no sliding-window attention" in str(report)
    assert {s.dtype for s in report.skipped if s.case == "*"} == {"float32"}
    assert {r.case for r in report.results if r.case.startswith("decode")} == {
        "decode/p16/gqa4/d128",
        "decode/p16/gqa8/d64",
    }
    decode_calls = standin.count("npu_fused_infer_attention_score")
    assert decode_calls == 2 * 2  # the two p16 decode cases in two dtypes; p16 extend took the torch route
    assert {c["key_shape"][1:] for _, c in standin.calls} == {(2, 16, 128), (1, 16, 64)}  # head-major pages

    report = check_attention_backend(CpuNpuAttention, device="cpu", cases=PREFILL_CASES)
    print(report)
    report.raise_for_failures()
    assert len(report.results) == 2 * len(PREFILL_CASES)
    prefill = [c for name, c in standin.calls if name == "npu_fused_infer_attention_score" and c["q_shape"][2] > 1]
    assert len(prefill) == 2 * 2 and all(c["sparse_mode"] == 3 for c in prefill)
    first = prefill[0]  # extend/prefix/p128 in bfloat16 (float32 is skipped)
    assert first["q_shape"] == (3, 8, 150, 64) and first["actual_seq_lengths"] == [20, 150, 9]
    assert first["actual_seq_lengths_kv"] == [148, 150, 46] and first["block_table"].shape == (3, 2)


def test_standin_rejects_what_the_documentation_forbids():
    standin = StandInTorchNpu()
    q = torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16)
    cache = torch.zeros(3, 2, 16, 16, dtype=torch.bfloat16)  # (blocknum, KV_N, blocksize, D), blocksize 16
    table = torch.tensor([[1]], dtype=torch.int32)
    with pytest.raises(StandInError, match="block_size 16: 128..512"):
        standin.npu_fused_infer_attention_score(
            q,
            cache,
            cache,
            block_table=table,
            block_size=16,
            actual_seq_lengths=[4],
            actual_seq_lengths_kv=[4],
            num_heads=2,
            num_key_value_heads=2,
            input_layout="BNSD",
            sparse_mode=3,
        )
    with pytest.raises(StandInError, match="block_table must be a 2-D int32"):
        standin.npu_fused_infer_attention_score(
            q[:, :, :1].contiguous(),
            cache,
            cache,
            block_table=table.long(),
            block_size=16,
            actual_seq_lengths_kv=[4],
            num_heads=2,
            input_layout="BNSD",
        )


def test_attention_kit_with_a_token_major_pool(monkeypatch):
    """The same backend on a token-major pool passes the cache as (blocknum, blocksize, H)."""
    standin = install(monkeypatch)

    class TokenMajor(CpuNpuAttention):
        kv_layout = KVLayout()

    report = check_attention_backend(TokenMajor, device="cpu", cases=PREFILL_CASES)
    print(report)
    report.raise_for_failures(min_run=2 * len(PREFILL_CASES))
    shapes = {c["key_shape"][1:] for name, c in standin.calls if name == "npu_fused_infer_attention_score"}
    assert shapes == {(128, 2 * 64), (128, 4 * 128), (128, 1 * 64)}


def test_head_major_kv_pool():
    """The layout hook in the core: a head-major pool stores a slot's K/V at
    [page, :, offset] and refuses the slot-major view."""
    pool = KVPool(3, 4, 2, 2, 8, torch.float32, torch.device("cpu"), layout=KVLayout(head_major=True))
    assert pool.k_buffers[0].shape == (4, 2, 4, 8) and pool.size == 12
    loc = torch.tensor([5, 13, 6])  # page 1 offset 1, page 3 offset 1, page 1 offset 2
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    pool.set_kv(1, loc, k, v)
    k_pages, v_pages = pool.get_kv_pages(1)
    assert torch.equal(k_pages[1, :, 1], k[0]) and torch.equal(k_pages[3, :, 1], k[1])
    assert torch.equal(v_pages[1, :, 2], v[2])
    assert int((k_pages != 0).any(dim=(1, 3)).sum()) == 3 and not pool.k_buffers[0].any()
    with pytest.raises(ValueError, match="head-major"):
        pool.get_kv(1)
    flat = KVPool(3, 4, 2, 2, 8, torch.float32, torch.device("cpu"))
    flat.set_kv(1, loc, k, v)
    assert flat.get_kv_pages(1)[0].shape == (4, 4, 2, 8)
    assert torch.equal(flat.get_kv_pages(1)[0][3, 1], k[1]) and torch.equal(flat.get_kv(1)[0][13], k[1])


# -- MoE through the stand-in grouped matmul ------------------------------------


@pytest.mark.parametrize("with_grouped_matmul", [True, False], ids=["npu_grouped_matmul", "torch-route"])
def test_moe_kit_through_the_standin(monkeypatch, with_grouped_matmul):
    standin = install(monkeypatch, StandInTorchNpu(with_grouped_matmul=with_grouped_matmul))
    report = check_moe_backend(CpuNpuMoE, device="cpu")
    print(report)
    report.raise_for_failures(min_run=3 * len(MOE_CASES["standard"]))
    calls = standin.count("npu_grouped_matmul")
    assert calls == (2 * len(report.results) if with_grouped_matmul else 0)


# -- a whole generation, in process, through the stand-in -----------------------


class StandInNpuPlugin:
    """Registers the NPU attention under its own name, allowed on cpu."""

    class Attention(CpuNpuAttention):
        name = "npu_fused_standin"

    @hookimpl
    def register_attention_backends(self, register):
        register(self.Attention)


@pytest.mark.parametrize("page_size", [16, 128])
def test_generation_through_the_npu_attention_matches_torch(monkeypatch, tiny_model_factory, page_size):
    """The scheduler and model runner end to end: the runner builds the head-major
    pool the backend declares, and prefill (after a cached shared prefix) and
    decode go through the stand-in operator. The log-probabilities of the tokens
    it generates equal torch_native's for the same tokens (fed back as a prompt):
    float16 greedy tokens themselves may flip between two correct backends."""
    standin = install(monkeypatch)
    model_dir = tiny_model_factory()
    prompts = mixed_prompts(512, [150, 7, 40], seed=5, shared_prefix=130)

    def scheduler(backend: str):
        registry = PluginRegistry()
        registry.register_plugin(StandInNpuPlugin(), "npu-standin")
        sched = make_scheduler(
            model_dir, registry=registry, attention_backend=backend, dtype="float16", page_size=page_size
        )
        assert sched.runner.kv_pool.layout == registry.candidates["attention"][backend].cls.kv_layout
        return sched

    npu = scheduler("npu_fused_standin")
    assert npu.runner.kv_pool.layout.head_major
    results = generate(npu, prompts, max_new_tokens=12, ignore_eos=True, return_logprob=True)
    q_lens = {c["q_shape"][2] for name, c in standin.calls if name == "npu_fused_infer_attention_score"}
    assert 1 in q_lens and (max(q_lens) > 1) == (page_size == 128)  # multi-token prefill: the operator at 128
    assert results[1].cached_tokens >= 128  # the shared prefix came from the radix cache

    reference = scheduler("torch_native")
    forced = generate(
        reference,
        [p + r.output_ids for p, r in zip(prompts, results, strict=False)],
        max_new_tokens=1,
        return_logprob=True,
        logprob_start_len=min(len(p) for p in prompts),
    )
    for prompt, result, ref in zip(prompts, results, forced, strict=False):
        expected = [lp for lp, _ in ref.input_logprobs[len(prompt) - min(len(p) for p in prompts) :]]
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(expected), atol=0.05, rtol=0.01)
