"""The FlashInfer backend (hardware/cuda): its per-step page lists, built on the
CPU here from real ForwardBatches, what ``radixserve plugins`` says without it,
and (marked ``cuda``, skipped without a GPU and flashinfer) the conformance kit
and graph capture on the GPU."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from helpers_platform import installed_plugins_report

from radixserve.cache.memory_pool import KVPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import KernelQuery
from radixserve.registry import PluginError, get_registry
from radixserve.testing import ATTENTION_CASES, check_attention_backend, dense_attention, make_attention_inputs
from radixserve_cuda.flashinfer_attention import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    FlashInferAttention,
    PagedKVIndex,
    batch_paged_kv_index,
    build_paged_kv_index,
)

FLASHINFER_INSTALLED = importlib.util.find_spec("flashinfer") is not None


def i32(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def make_batch(
    mode: ForwardMode, page_size: int, rows: dict[int, list[int]], prefix_lens: list[int], extend_lens: list[int]
) -> ForwardBatch:
    """A ForwardBatch whose request ``i`` is slot-table row ``list(rows)[i]`` holding
    the slots ``rows[row]`` (its whole sequence)."""
    table = torch.zeros((8, 64), dtype=torch.int64)
    for row, slots in rows.items():
        table[row, : len(slots)] = torch.tensor(slots)
    seq = [p + n for p, n in zip(prefix_lens, extend_lens, strict=False)]
    assert seq == [len(s) for s in rows.values()]
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    out_loc = torch.cat([t(slots[p:]) for slots, p in zip(rows.values(), prefix_lens, strict=False)])
    return ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq, strict=False)]),
        out_cache_loc=out_loc,
        req_pool_indices=t(list(rows)),
        seq_lens=t(seq),
        prefix_lens=t(prefix_lens),
        extend_lens=t(extend_lens),
        req_to_token=table,
        kv_pool=KVPool(64, page_size, 1, 1, 8, torch.float32, torch.device("cpu")),
        seq_lens_cpu=seq,
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
    )


def assert_index(index: PagedKVIndex, indptr, indices, last, qo=None) -> None:
    assert index.kv_indptr.dtype == index.kv_indices.dtype == index.kv_last_page_len.dtype == torch.int32
    assert index.kv_indptr.tolist() == indptr
    assert index.kv_indices.tolist() == indices
    assert index.kv_last_page_len.tolist() == last
    assert (index.qo_indptr.tolist() if index.qo_indptr is not None else None) == qo


def test_ragged_decode_page_size_1():
    # Page size 1: every slot is its own page, listed in position order.
    batch = make_batch(ForwardMode.DECODE, 1, {5: [9, 4, 30, 2], 1: [7], 3: [11, 12]}, [3, 0, 1], [1, 1, 1])
    assert_index(batch_paged_kv_index(batch), [0, 4, 5, 7], [9, 4, 30, 2, 7, 11, 12], [1, 1, 1])


def test_ragged_decode_page_size_16():
    # 20 tokens: page 3 (slots 48..63) then 4 slots of page 1; 16 tokens: all of page 5;
    # 1 token: the first slot of page 2.
    rows = {1: list(range(48, 64)) + [16, 17, 18, 19], 6: list(range(80, 96)), 0: [32]}
    batch = make_batch(ForwardMode.DECODE, 16, rows, [19, 15, 0], [1, 1, 1])
    assert_index(batch_paged_kv_index(batch), [0, 2, 3, 4], [3, 1, 5, 2], [4, 16, 1])


def test_extend_with_cached_prefixes_page_size_16():
    # A cached page-aligned prefix of 16 + 5 new; no prefix + 3 new; a prefix ending
    # mid-page (21) + 12 new, continuing in the tail of its page 6 then page 2.
    rows = {
        2: list(range(64, 80)) + list(range(112, 117)),
        4: [128, 129, 130],
        0: list(range(16, 32)) + list(range(96, 112)) + [32],
    }
    batch = make_batch(ForwardMode.EXTEND, 16, rows, [16, 0, 21], [5, 3, 12])
    assert_index(batch_paged_kv_index(batch), [0, 2, 3, 6], [4, 7, 8, 1, 6, 2], [5, 3, 1], qo=[0, 5, 8, 20])


def test_extend_with_cached_prefixes_page_size_1():
    batch = make_batch(ForwardMode.EXTEND, 1, {3: [8, 2, 6, 1, 9], 7: [4, 5]}, [3, 0], [2, 2])
    assert_index(batch_paged_kv_index(batch), [0, 5, 7], [8, 2, 6, 1, 9, 4, 5], [1, 1], qo=[0, 2, 4])


def test_empty_batch():
    index = build_paged_kv_index(
        torch.zeros((2, 4), dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        [],
        16,
        [],
    )
    assert_index(index, [0], [], [], qo=[0])


@pytest.mark.parametrize("case", ATTENTION_CASES["full"], ids=lambda c: c.name)
def test_index_addresses_every_token_of_the_kit_batches(case):
    """On the kit's randomly paged batches (shuffled pages and rows, garbage
    elsewhere): reading slot ``indices[indptr[i] + pos // ps] * ps + pos % ps``, as
    FlashInfer does through the NHD view of the pool, gives every position's slot."""
    inputs = make_attention_inputs(case, torch.float32, seed=3)
    batch, ps = inputs.batch, case.page_size
    index = batch_paged_kv_index(batch)
    for i, (row, seq) in enumerate(zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu, strict=False)):
        pages = index.kv_indices[index.kv_indptr[i] : index.kv_indptr[i + 1]].long()
        assert len(pages) == -(-seq // ps) and 1 <= index.kv_last_page_len[i] <= ps
        assert (len(pages) - 1) * ps + int(index.kv_last_page_len[i]) == seq
        pos = torch.arange(seq)
        assert torch.equal(pages[pos // ps] * ps + pos % ps, batch.req_to_token[row, :seq])


def paged_attention_as_flashinfer_reads_it(inputs) -> torch.Tensor:
    """Attention computed only from the page lists and the NHD page view of the pool,
    with FlashInfer's causal rule (queries aligned to the end of the KV)."""
    batch, case = inputs.batch, inputs.case
    ps, group = case.page_size, case.num_heads // case.num_kv_heads
    index = batch_paged_kv_index(batch)
    k_pages, v_pages = batch.kv_pool.get_kv_pages(case.layer_id)
    qo = index.qo_indptr.tolist() if index.qo_indptr is not None else list(range(batch.batch_size + 1))
    outs = []
    for i in range(batch.batch_size):
        pages = index.kv_indices[index.kv_indptr[i] : index.kv_indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * ps + int(index.kv_last_page_len[i])
        k = k_pages[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
        v = v_pages[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
        q = inputs.q[qo[i] : qo[i + 1]]
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.softmax_scale
        q_pos = torch.arange(kv_len - len(q), kv_len)[:, None]
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "case",
    [c for c in ATTENTION_CASES["standard"] if c.sliding_window is None and c.logit_softcap is None],
    ids=lambda c: c.name,
)
def test_page_lists_and_nhd_view_give_the_kits_attention(case):
    """The plan's arrays over the pool's page view ``[pages, page_size, kv_heads,
    head_dim]`` (no copy: FlashInfer's NHD layout) describe exactly the attention
    the kit defines."""
    inputs = make_attention_inputs(case, torch.float32, seed=5)
    pool = inputs.batch.kv_pool
    pool.set_kv(case.layer_id, inputs.batch.out_cache_loc, inputs.k, inputs.v)
    pages = pool.get_kv_pages(case.layer_id)[0]
    assert pages.shape[1] == case.page_size and pages.data_ptr() == pool.get_kv(case.layer_id)[0].data_ptr()
    out = paged_attention_as_flashinfer_reads_it(inputs)
    torch.testing.assert_close(out.double(), dense_attention(inputs), atol=1e-5, rtol=1e-5)


def test_plugins_json_lists_flashinfer_unusable_with_reasons():
    report = installed_plugins_report()
    cuda = next(p for p in report["plugins"] if p["name"] == "cuda")
    assert "flashinfer" in cuda["registered"]["attention"]
    row = next(r for r in report["backends"]["attention"] if r["name"] == "flashinfer")
    if torch.cuda.is_available() and FLASHINFER_INSTALLED:
        pytest.skip("flashinfer is usable on this machine")
    assert row["usable"] is False and row["priority"] > 10  # above triton where usable
    if not FLASHINFER_INSTALLED:
        assert "flashinfer is not installed (pip install 'radixserve-plugin-cuda[flashinfer]')" in row["reasons"]
    if report["device_checked"] != "cuda":
        assert f"FlashInfer runs on the cuda device, not {report['device_checked']!r}" in row["reasons"]


def test_unsupported_shapes_are_named():
    query = KernelQuery(
        device="cuda", dtype=torch.float32, head_dim=96, num_heads=6, num_kv_heads=4, kv_dtype=torch.float16
    )
    reasons = FlashInferAttention.unsupported_reasons(query)
    assert "dtype torch.float32 is not supported (bfloat16, float16 are)" in reasons
    assert "KV cache dtype torch.float16 differs from the model dtype torch.float32" in reasons
    assert "head_dim 96 is not supported (64, 128, 256 are)" in reasons
    assert "num_heads 6 is not a multiple of num_kv_heads 4" in reasons
    # Windows and caps are not wired to FlashInfer's plans (docs/cuda.md): such models go to triton.
    gemma2 = dataclasses.replace(query, sliding_window=4096, logit_softcap=50.0)
    reasons = FlashInferAttention.unsupported_reasons(gemma2)
    assert "flashinfer has no sliding-window attention (the model has windowed layers)" in reasons
    assert "flashinfer has no attention logit soft-capping (the model caps its scores)" in reasons


def test_forcing_flashinfer_where_unusable_is_loud():
    query = KernelQuery(device="cpu", dtype=torch.bfloat16, head_dim=128, num_heads=8, num_kv_heads=2)
    with pytest.raises(PluginError, match="flashinfer"):
        get_registry().select("attention", query, "flashinfer")


@pytest.mark.skipif(FLASHINFER_INSTALLED, reason="flashinfer is installed here")
def test_building_without_flashinfer_says_how_to_install():
    query = KernelQuery(device="cuda", dtype=torch.bfloat16, head_dim=128, num_heads=8, num_kv_heads=2)
    with pytest.raises(RuntimeError, match=r"pip install 'radixserve-plugin-cuda\[flashinfer\]'"):
        FlashInferAttention(query)


# ---------------------------------------------------------------------------
# On an NVIDIA GPU with flashinfer installed (scripts/gpu_check.sh)


def _gpu_unavailable() -> str | None:
    query = KernelQuery(device="cuda", dtype=torch.bfloat16, head_dim=128, num_heads=8, num_kv_heads=2)
    reasons = FlashInferAttention.unsupported_reasons(query)
    return "; ".join(reasons) if reasons else None


def on_gpu(test):
    test = pytest.mark.skipif(_gpu_unavailable() is not None, reason=_gpu_unavailable() or "")(test)
    return pytest.mark.cuda(test)


@on_gpu
def test_flashinfer_kit_on_cuda():
    report = check_attention_backend("flashinfer", device="cuda", cases="full")
    print(report)
    # Every full case of a head dim FlashInfer has kernels for (not d96), in bfloat16 and float16,
    # but those with a sliding window or a logit cap, which it refuses (docs/cuda.md).
    featured = {c.name for c in ATTENTION_CASES["full"] if c.sliding_window or c.logit_softcap}
    cases = sum(c.head_dim in SUPPORTED_HEAD_DIMS and c.name not in featured for c in ATTENTION_CASES["full"])
    report.raise_for_failures(min_run=len(SUPPORTED_DTYPES) * cases)
    assert featured <= {s.case for s in report.skipped}


@on_gpu
def test_flashinfer_decode_graph_replays_after_replanning():
    """Capture a decode step on one batch, then replay it on a batch of the same
    size with other lengths (shapes kept equal): the replay re-plans and matches
    the kit's dense attention."""
    from radixserve.testing.conformance import AttentionCase

    first = AttentionCase("a", "decode", 16, 8, 2, 128, (0, 16, 39), (1, 1, 1))
    second = AttentionCase("b", "decode", 16, 8, 2, 128, (39, 16, 0), (1, 1, 1))
    dtype = torch.bfloat16
    static = make_attention_inputs(first, dtype, "cuda", seed=1)
    fresh = make_attention_inputs(second, dtype, "cuda", seed=2)
    backend = FlashInferAttention(first.query("cuda", dtype))
    b = static.batch
    backend.init_graph_state(max_bs=4, max_context=b.req_to_token.shape[1], device=b.seq_lens.device)
    b.seq_lens_cpu, b.prefix_lens_cpu, b.extend_lens_cpu = [], [], []
    backend.init_forward_metadata_capture(b)
    backend.forward(static.q, static.k, static.v, static.layer, b)  # warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(static.q, static.k, static.v, static.layer, b)

    for name in ("q", "k", "v"):
        getattr(static, name).copy_(getattr(fresh, name))
    for name in ("req_to_token", "req_pool_indices", "seq_lens", "out_cache_loc"):
        getattr(b, name).copy_(getattr(fresh.batch, name))
    for mine, theirs in zip(
        b.kv_pool.k_buffers + b.kv_pool.v_buffers,
        fresh.batch.kv_pool.k_buffers + fresh.batch.kv_pool.v_buffers,
        strict=False,
    ):
        mine.copy_(theirs)
    b.seq_lens_cpu = list(fresh.batch.seq_lens_cpu)
    backend.init_forward_metadata_replay(b)
    graph.replay()
    torch.cuda.synchronize()
    expected = dense_attention(fresh)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-2, rtol=2e-2)
