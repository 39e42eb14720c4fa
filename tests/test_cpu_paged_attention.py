"""cpu_paged: decode attention read in place from the KV pool by a C++ kernel.

The conformance kit against torch_native (every dtype, page sizes 1 and 16,
prefixes, GQA 1-8, head dims 32-256, split long contexts, large ragged
batches, sliding windows and logit caps on every path); ``auto`` picks it on
cpu, and ``torch_varlen`` when no compiler is found; a build failure is a loud
error naming the compiler's message; whole generations give the same greedy
tokens as torch_native. The kernel is built once per machine (conftest builds it
before the first test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from generation_utils import generate, make_scheduler, mixed_prompts

from radixserve.kernels import KernelQuery
from radixserve.registry import PluginError, get_registry
from radixserve.testing import check_attention_backend
from radixserve.testing.conformance import AttentionCase, make_attention_inputs
from radixserve_torch import attention_cpu_paged, cpu_kernels
from radixserve_torch.attention_cpu_paged import CpuPagedAttention, plan_cascade
from radixserve_torch.cpu_kernels import KernelBuildError
from radixserve_torch.elementwise_cpu import CpuFusedElementwise

# The generation comparisons name the attention backend; the others by priority, so that no
# scheduler times candidates on its chunk size's shapes at start-up.
PRIORITY = {"backend_selection": "priority"}

_lens = [(37 * i) % 1200 + 20 for i in range(40)]
EXTRA_CASES = (
    # One or two long requests: the kernel splits their keys across threads and merges.
    AttentionCase("decode/split/p1/gqa2/d64", "decode", 1, 16, 8, 64, (3000,), (1,)),
    AttentionCase("decode/split/p16/gqa8/d128", "decode", 16, 8, 1, 128, (1500, 40), (1, 1)),
    AttentionCase("decode/ragged40/p1/gqa2/d64", "decode", 1, 8, 4, 64, tuple(s - 1 for s in _lens), (1,) * 40),
    AttentionCase(
        "decode/ragged24/p16/gqa8/d128", "decode", 16, 8, 1, 128, tuple(s - 1 for s in _lens[:24]), (1,) * 24
    ),
    # Every layout of the score loops: groups of 8 heads (qwen2's decode shape, a context past
    # 1000 keys), 4, 2 and 1 heads; and head dims off the vector loops (40: the portable loops).
    AttentionCase("decode/qwen2/p1/gqa8/d32", "decode", 1, 16, 2, 32, (1100, 4, 346, 33, 699), (1,) * 5),
    AttentionCase("decode/gqa4/p16/d64", "decode", 16, 8, 2, 64, (300, 30), (1, 1)),
    AttentionCase("decode/d32/p1/gqa2", "decode", 1, 4, 2, 32, (70, 5), (1, 1)),
    AttentionCase("decode/d80/p16/gqa1", "decode", 16, 2, 2, 80, (33, 200), (1, 1)),
    AttentionCase("decode/d40/p1/gqa2", "decode", 1, 4, 2, 40, (90, 16), (1, 1)),
    # Extend goes through torch_varlen's path, with and without cached prefixes.
    AttentionCase("extend/ragged/p16/gqa2/d64", "extend", 16, 4, 2, 64, (0, 300, 0, 17), (260, 90, 7, 150)),
    # Work items of four tiles over a long cached prefix, and a 7-key prefix, where an item's
    # first tile ends a whole key block before its last one.
    AttentionCase("extend/prefix1024/p1/gqa2/d64", "extend", 1, 16, 8, 64, (1024, 7, 0), (64, 40, 200)),
    # An odd head_dim: bfloat16 scores without vdpbf16ps pairs (its P.V still pairs keys).
    AttentionCase("extend/d33/p1/gqa2", "extend", 1, 4, 2, 33, (0, 40, 7), (70, 20, 5)),
    # Windows and caps on the same paths: a windowed long decode split across threads (its
    # ranges cut from the window's keys), a batch too large to split, key-major scores (groups
    # of 8), the portable loops, extend tiles whose rows' windows start blocks apart (rows with
    # no key yet in a block), windows over a long cached prefix, and the unpaired bfloat16 scores.
    AttentionCase(
        "decode/split/window1000+softcap/p1/gqa2/d64",
        "decode",
        1,
        16,
        8,
        64,
        (3000,),
        (1,),
        sliding_window=1000,
        logit_softcap=20.0,
    ),
    AttentionCase(
        "decode/ragged40/window200+softcap/p16/gqa4/d64",
        "decode",
        16,
        8,
        2,
        64,
        tuple(s - 1 for s in _lens),
        (1,) * 40,
        sliding_window=200,
        logit_softcap=8.0,
    ),
    AttentionCase(
        "decode/qwen2/window300+softcap/p1/gqa8/d32",
        "decode",
        1,
        16,
        2,
        32,
        (1100, 4, 346, 33, 699),
        (1,) * 5,
        sliding_window=300,
        logit_softcap=10.0,
    ),
    AttentionCase(
        "decode/d40/window50+softcap/p1/gqa2",
        "decode",
        1,
        4,
        2,
        40,
        (90, 16),
        (1, 1),
        sliding_window=50,
        logit_softcap=3.0,
    ),
    AttentionCase("extend/window5/long/p1/gqa1/d64", "extend", 1, 2, 2, 64, (0, 100), (300, 150), sliding_window=5),
    AttentionCase(
        "extend/window40+softcap/prefix1024/p16/gqa8/d32",
        "extend",
        16,
        16,
        2,
        32,
        (1024, 7, 0),
        (64, 40, 200),
        sliding_window=40,
        logit_softcap=5.0,
    ),
    AttentionCase(
        "extend/d33/window9+softcap/p1/gqa2",
        "extend",
        1,
        4,
        2,
        33,
        (0, 40, 7),
        (70, 20, 5),
        sliding_window=9,
        logit_softcap=2.0,
    ),
)


def test_conformance_kit_passes_for_every_dtype():
    report = check_attention_backend("cpu_paged", device="cpu")
    print(report)
    report.raise_for_failures()
    assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}
    assert not report.skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_conformance_kit_passes_on_split_ragged_and_odd_shapes(dtype):
    report = check_attention_backend("cpu_paged", device="cpu", dtypes=[dtype], cases=EXTRA_CASES)
    print(report)
    report.raise_for_failures()
    assert len(report.results) == len(EXTRA_CASES)


def test_strided_queries_from_a_fused_projection():
    case = EXTRA_CASES[2]
    inputs = make_attention_inputs(case, torch.bfloat16)
    backend = CpuPagedAttention(case.query("cpu", torch.bfloat16))
    backend.init_forward_metadata(inputs.batch)
    t, h, d = inputs.q.shape
    fused = torch.randn(t, (h + 4) * d).to(torch.bfloat16)  # q then other columns, as a QKV projection
    fused[:, : h * d] = inputs.q.reshape(t, h * d)
    q_view = fused[:, : h * d].view(t, h, d)
    assert not q_view.is_contiguous()
    expected = backend.forward_decode(inputs.q, inputs.layer, inputs.batch)
    assert torch.equal(backend.forward_decode(q_view, inputs.layer, inputs.batch), expected)


def test_auto_selects_it_on_cpu_and_torch_varlen_without_a_compiler_or_compiled_kernels(monkeypatch, request):
    registry = get_registry()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        query = KernelQuery(device="cpu", dtype=dtype, head_dim=64, num_heads=16, num_kv_heads=8)
        assert registry.select("attention", query) is CpuPagedAttention
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    # The installation's compiled kernels need no compiler (setup.py built them) ...
    assert CpuPagedAttention.unsupported_reasons(query) == []
    # ... an installation without them does.
    request.getfixturevalue("without_installed_kernels")
    assert CpuPagedAttention.unsupported_reasons(query) == [
        "no C++ compiler found (looked for 'no-such-c++-compiler' on PATH)"
    ]
    assert registry.select("attention", query).name == "torch_varlen"
    with pytest.raises(PluginError, match=r"no C\+\+ compiler found"):
        registry.select("attention", query, "cpu_paged")
    cuda = KernelQuery(device="cuda", dtype=torch.bfloat16, head_dim=64, num_heads=16, num_kv_heads=8)
    assert "a CPU kernel; device is cuda" in CpuPagedAttention.unsupported_reasons(cuda)


def test_a_build_failure_is_loud_and_names_the_compiler_error(tmp_path, monkeypatch, without_installed_kernels):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "SOURCES", [broken])
    monkeypatch.setattr(cpu_kernels, "extension_name", lambda target=None: "radixserve_cpu_kernels_broken_test")
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_build_error", None)
    query = KernelQuery(device="cpu", dtype=torch.float32, head_dim=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(KernelBuildError, match=r"building the CPU kernels failed: .*error.*this"):
        CpuPagedAttention(query)
    # Once failed in a process, each backend's build says so at once (and auto moves on to the next).
    with pytest.raises(KernelBuildError, match="building the CPU kernels failed:") as first:
        CpuPagedAttention.build()
    with pytest.raises(KernelBuildError) as second:
        CpuFusedElementwise.build()  # the elementwise ops share the library
    assert str(first.value) == str(second.value)
    assert get_registry().select("attention", query).name == "torch_varlen"


@pytest.mark.parametrize("page_size", [1, 16])
def test_generation_matches_torch_native(tiny_llama_dir, page_size):
    # Shared prefixes (radix hits), ragged lengths, chunked prefill over a cached prefix.
    prompts = mixed_prompts(512, [5, 60, 17, 33], seed=3, shared_prefix=40) + mixed_prompts(512, [90, 2, 47], seed=4)
    outputs = {}
    for backend in ("torch_native", "cpu_paged"):
        scheduler = make_scheduler(
            tiny_llama_dir, attention_backend=backend, page_size=page_size, chunked_prefill_size=64, **PRIORITY
        )
        name = scheduler.runner.summary()["backends"]["attention"]
        assert name == backend
        outputs[name] = [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=24, ignore_eos=True)]
    assert outputs["cpu_paged"] == outputs["torch_native"]
    assert all(len(o) == 24 for o in outputs["cpu_paged"])


# Extend shapes of both benchmark models: fresh prompts, a chunk over a long cached
# prefix, a single new token (a tile with one query), GQA 8 at head_dim 32 (qwen2). With
# AMX, bfloat16 head dims that are multiples of 32 take the tiles: 32, 64, 128 and 96 (a
# last pass of two component tiles); 80 stays on the AVX-512 pairs.
EXTEND_CASES = (
    AttentionCase("extend/fresh/p1/gqa2/d64", "extend", 1, 16, 8, 64, (0, 0, 0), (200, 37, 129)),
    AttentionCase("extend/prefix/p1/gqa8/d32", "extend", 1, 16, 2, 32, (1024, 300, 0), (64, 1, 70)),
    AttentionCase("extend/prefix/p16/gqa2/d128", "extend", 16, 8, 4, 128, (513, 16), (40, 33)),
    AttentionCase("extend/prefix/p1/gqa4/d96", "extend", 1, 8, 2, 96, (100, 0), (45, 17)),
    AttentionCase("extend/prefix/p1/mha/d80", "extend", 1, 3, 3, 80, (7, 0), (21, 5)),
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conformance_kit_passes_for_extend_tiles(dtype):
    report = check_attention_backend("cpu_paged", device="cpu", dtypes=[dtype], cases=EXTEND_CASES)
    print(report)
    report.raise_for_failures()
    assert len(report.results) == len(EXTEND_CASES)


def test_float32_model_over_a_bfloat16_pool_matches_torch_native(tiny_llama_dir):
    prompts = mixed_prompts(512, [5, 60, 17], seed=5, shared_prefix=30)
    outputs = {}
    for backend in ("torch_native", "cpu_paged"):
        scheduler = make_scheduler(
            tiny_llama_dir,
            attention_backend=backend,
            dtype="float32",
            kv_cache_dtype="bfloat16",
            chunked_prefill_size=32,
            **PRIORITY,
        )
        outputs[backend] = [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=16, ignore_eos=True)]
    assert outputs["cpu_paged"] == outputs["torch_native"]
    query = KernelQuery(
        device="cpu", dtype=torch.float32, head_dim=64, num_heads=4, num_kv_heads=2, kv_dtype=torch.bfloat16
    )
    assert CpuPagedAttention.unsupported_reasons(query) == []
    reverse = KernelQuery(
        device="cpu", dtype=torch.bfloat16, head_dim=64, num_heads=4, num_kv_heads=2, kv_dtype=torch.float32
    )
    assert CpuPagedAttention.unsupported_reasons(reverse) == [
        "a KV pool in torch.float32 under torch.bfloat16 compute is not supported "
        "(the pool holds the compute dtype, or bfloat16/float16 under float32)"
    ]


def _decode_reference(q, batch, layer) -> torch.Tensor:
    """Float32 attention of each request's query over its keys read through
    req_to_token (the last ``layer.sliding_window`` of them; scores capped)."""
    k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
    out = []
    for i, (row, n) in enumerate(zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist(), strict=False)):
        slots = batch.req_to_token[row, max(0, n - (layer.sliding_window or n)) : n]
        k = k_buf[slots].float().repeat_interleave(layer.num_heads // layer.num_kv_heads, 1)  # [n, H, D]
        v = v_buf[slots].float().repeat_interleave(layer.num_heads // layer.num_kv_heads, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * layer.scaling
        if layer.logit_softcap is not None:
            scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _shared_prefix_inputs(dtype, heads, kv_heads, head_dim, **features):
    # Requests 0-5 share request 0's first 200 slots (5 of them also share to 260), 7-10 share
    # request 7's first 96 (10 only 50: the group's common prefix is then 50, below the
    # threshold, and the group is dropped), 6 shares nothing; as the radix cache lays
    # out requests with a common cached prefix.
    lens = [300, 310, 290, 305, 270, 280, 40, 500, 280, 120, 200]
    case = AttentionCase(
        "decode/shared",
        "decode",
        1,
        heads,
        kv_heads,
        head_dim,
        tuple(n - 1 for n in lens),
        (1,) * len(lens),
        **features,
    )
    inputs = make_attention_inputs(case, dtype, seed=7)
    table, rows = inputs.batch.req_to_token, inputs.batch.req_pool_indices.tolist()
    for i in (1, 2, 3, 4, 5):
        table[rows[i], :200] = table[rows[0], :200]
    table[rows[5], 200:260] = table[rows[4], 200:260]
    for i, n in ((8, 96), (9, 96), (10, 50)):
        table[rows[i], :n] = table[rows[7], :n]
    return case, inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 64), (16, 2, 32), (8, 4, 80)])
def test_decode_over_shared_prefixes_takes_the_cascade_path(dtype, heads, kv_heads, head_dim):
    case, inputs = _shared_prefix_inputs(dtype, heads, kv_heads, head_dim)
    batch = inputs.batch
    backend = CpuPagedAttention(case.query("cpu", dtype))
    backend.init_forward_metadata(batch)
    plan = batch.attn_metadata.cascade
    assert plan is not None
    assert plan.grouped.tolist() == [0, 1, 2, 3, 4, 5] and plan.shared_lens.tolist() == [200]
    assert plan.solo.tolist() == [6, 7, 8, 9, 10]
    out = backend.forward(inputs.q, inputs.k, inputs.v, inputs.layer, batch)
    expected = _decode_reference(inputs.q, batch, inputs.layer)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    # Without the plan (every request through the plain decode kernel) the result agrees too.
    batch.attn_metadata.cascade = None
    torch.testing.assert_close(
        backend.forward_decode(inputs.q, inputs.layer, batch).float(), expected, atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_capped_decode_cascades_and_windowed_decode_does_not(dtype):
    """A capped layer's shared prefixes go through the cascade kernels, capped in both
    parts; a windowed layer of the same step decodes every request plainly over its
    window (the shared prefix lies mostly outside it)."""
    case, inputs = _shared_prefix_inputs(dtype, 16, 8, 64, sliding_window=120, logit_softcap=4.0)
    batch = inputs.batch
    backend = CpuPagedAttention(case.query("cpu", dtype))
    cascades = []
    kernels = backend._kernels
    backend._kernels = dataclasses.replace(kernels, cascade=lambda *a: cascades.append(1) or kernels.cascade(*a))
    backend.init_forward_metadata(batch)
    assert batch.attn_metadata.cascade is not None
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for layer in (inputs.global_layer, inputs.layer):  # capped, then capped and windowed
        before = len(cascades)
        out = backend.forward(inputs.q, inputs.k, inputs.v, layer, batch)
        assert len(cascades) - before == (1 if layer.sliding_window is None else 0)
        torch.testing.assert_close(out.float(), _decode_reference(inputs.q, batch, layer), atol=tol, rtol=tol)


def test_cascade_plan_needs_a_long_enough_prefix_and_group():
    table = torch.arange(4 * 300, dtype=torch.int64).view(4, 300) + 1
    table[1, :100] = table[0, :100]
    rows = torch.arange(4)
    assert plan_cascade(table, rows, [300, 300, 300, 300], group_size=2) is None  # 2 requests x 2 heads < 8 rows
    plan = plan_cascade(table, rows, [300, 300, 300, 300], group_size=4)
    assert plan.grouped.tolist() == [0, 1] and plan.shared_lens.tolist() == [100] and plan.solo.tolist() == [2, 3]
    table[1, 50] = 0
    assert plan_cascade(table, rows, [300, 300, 300, 300], group_size=4) is None  # 50 shared keys < 64
    table[1, :100] = table[0, :100]
    # A member whose context ends inside the common run keeps at least its last key to itself.
    plan = plan_cascade(table, rows, [300, 90, 300, 300], group_size=4)
    assert plan.shared_lens.tolist() == [89]


def test_generation_with_a_long_shared_prefix_matches_torch_native(tiny_llama_dir, monkeypatch):
    plans = []

    def recording_plan_cascade(*args, **kwargs):
        plans.append(plan_cascade(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(attention_cpu_paged, "plan_cascade", recording_plan_cascade)
    prompts = mixed_prompts(512, [9, 30, 4, 17, 25], seed=6, shared_prefix=150)
    outputs = {}
    for backend in ("torch_native", "cpu_paged"):
        scheduler = make_scheduler(tiny_llama_dir, attention_backend=backend, chunked_prefill_size=256, **PRIORITY)
        outputs[backend] = [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=20, ignore_eos=True)]
    assert outputs["cpu_paged"] == outputs["torch_native"]
    # The five requests decoded together over their cached 150-token prefix.
    assert any(p is not None and p.grouped.numel() == 5 and p.shared_lens.tolist() == [150] for p in plans)


@pytest.mark.parametrize(
    "src,pool",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
    ids=str,
)
def test_store_kv_writes_strided_rows_like_index_copy(src, pool):
    """K and V as the model hands them over (views of one fused projection), into
    scattered slots; a float32 model over a low-precision pool rounds as ``.to()``."""
    kernels = attention_cpu_paged.load_kernel()
    qkv = torch.randn(300, 3, 4, 32).to(src)
    k, v = qkv[:, 1], qkv[:, 2]
    loc = torch.randperm(511)[:300] + 1
    k_buf, v_buf = torch.zeros(512, 4, 32, dtype=pool), torch.zeros(512, 4, 32, dtype=pool)
    kernels.store_kv(k, v, loc, k_buf, v_buf)
    expected_k = torch.zeros_like(k_buf).index_copy_(0, loc, k.to(pool))
    expected_v = torch.zeros_like(v_buf).index_copy_(0, loc, v.to(pool))
    assert torch.equal(k_buf, expected_k) and torch.equal(v_buf, expected_v)


def test_store_kv_rejects_slots_outside_the_pool_and_unsupported_dtypes():
    kernels = attention_cpu_paged.load_kernel()
    k = v = torch.randn(2, 4, 32)
    k_buf, v_buf = torch.zeros(16, 4, 32), torch.zeros(16, 4, 32)
    with pytest.raises(RuntimeError, match="outside the pool of 16"):
        kernels.store_kv(k, v, torch.tensor([3, 16]), k_buf, v_buf)
    low = torch.zeros(16, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="torch.float16|Half"):
        kernels.store_kv(k.half(), v.half(), torch.tensor([1, 2]), low, low.clone())
    assert not k_buf.any()
