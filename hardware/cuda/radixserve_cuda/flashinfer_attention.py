"""``flashinfer``: paged prefill and decode attention from FlashInfer on NVIDIA GPUs.

The KV pool keeps, per layer, K and V as ``[slots, kv_heads, head_dim]`` with
``slots = (num_pages + 1) * page_size`` and every page's slots contiguous. That
is FlashInfer's NHD paged layout seen through ``KVPool.get_kv_pages`` as
``[num_pages + 1, page_size, kv_heads, head_dim]``: no copy, and page ``p``
holds slots ``p * page_size`` onwards (page 0 is the pool's reserved page,
never listed by a request).

Once per step, :func:`build_paged_kv_index` turns the batch's slot table into
FlashInfer's CSR page lists (torch ops, no loop over requests) and one wrapper
is planned: the paged prefill wrapper (causal, queries aligned to the end of
each request's KV, so a cached prefix is attended in full) for extend, the
decode wrapper for decode. Every layer then runs on that plan.

Importing this module never imports flashinfer: ``unsupported_reasons`` only
looks for it, so ``radixserve plugins`` can say why the backend is unusable.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import AttentionBackend, AttentionLayerSpec, KernelQuery, attention_feature_reasons

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'radixserve-plugin-cuda[flashinfer]'"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended split-k scratch size
# Query heads per KV head that decode with FlashInfer's CUDA-core kernel (it is
# built for 1, 2, 3, 4 and 8); larger groups take its tensor-core decode path,
# "faster for large group size" by FlashInfer's documentation, which runs the
# prefill kernel (so it adds no compile).
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4)

# (dtype, num_heads, num_kv_heads, head_dim, page_size) warmed up in this process.
_warmed: set[tuple[torch.dtype, int, int, int, int]] = set()


@dataclass
class PagedKVIndex:
    """FlashInfer's paged-KV description of one batch (all int32).

    Request ``i`` owns pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` in order,
    the last holding ``kv_last_page_len[i]`` (1..page_size) of its tokens. For an
    extend batch, its new queries are rows ``qo_indptr[i]:qo_indptr[i+1]``.
    The indptr and last-page arrays live on the host, where FlashInfer's planner
    reads them (so planning never waits for the device); ``kv_indices`` lives
    where the slot table does.
    """

    kv_indptr: torch.Tensor  # [B + 1] host
    kv_indices: torch.Tensor  # [kv_indptr[-1]] on the slot table's device
    kv_last_page_len: torch.Tensor  # [B] host
    qo_indptr: torch.Tensor | None = None  # [B + 1] host, extend only


def build_paged_kv_index(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: list[int],
    page_size: int,
    extend_lens_cpu: list[int] | None = None,
) -> PagedKVIndex:
    """Page lists for requests ``req_pool_indices`` holding ``seq_lens`` tokens.

    A request's ``j``-th page is the page of its slot at position ``j * page_size``
    (the allocator keeps each page's slots contiguous, so that one slot names the
    page). ``seq_lens`` is on the slot table's device, ``seq_lens_cpu`` its host
    copy; the page ids are gathered on the device in one pass.
    """
    device = req_to_token.device
    # FlashInfer's plan copies the host lists to the device; from page-locked memory
    # that copy does not wait for the device to finish the step before.
    pin = device.type == "cuda"
    seq_host = torch.tensor(seq_lens_cpu, dtype=torch.int64)
    pages_host = (seq_host + page_size - 1) // page_size
    kv_indptr = torch.zeros(len(seq_lens_cpu) + 1, dtype=torch.int32, pin_memory=pin)
    kv_indptr[1:] = torch.cumsum(pages_host, 0)
    total = int(kv_indptr[-1])

    pages = (seq_lens.to(torch.int64) + page_size - 1) // page_size
    owner = torch.repeat_interleave(torch.arange(len(seq_lens_cpu), device=device), pages, output_size=total)
    first = torch.cumsum(pages, 0) - pages  # each request's first entry in the flat list
    page_no = torch.arange(total, device=device) - first[owner]
    slots = req_to_token[req_pool_indices[owner], page_no * page_size]
    kv_indices = (slots // page_size).to(torch.int32)

    last_page_len = ((seq_host - 1) % page_size + 1).to(torch.int32)
    qo_indptr = None
    if extend_lens_cpu is not None:
        qo_indptr = torch.zeros(len(extend_lens_cpu) + 1, dtype=torch.int32, pin_memory=pin)
        qo_indptr[1:] = torch.cumsum(torch.tensor(extend_lens_cpu, dtype=torch.int64), 0)
    return PagedKVIndex(
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=last_page_len.pin_memory() if pin else last_page_len,
        qo_indptr=qo_indptr,
    )


def batch_paged_kv_index(batch: ForwardBatch) -> PagedKVIndex:
    """:func:`build_paged_kv_index` for a ForwardBatch (qo_indptr for extend batches)."""
    seq = batch.seq_lens_cpu or batch.seq_lens.tolist()
    extend = None
    if batch.mode is ForwardMode.EXTEND:
        extend = batch.extend_lens_cpu or batch.extend_lens.tolist()
    return build_paged_kv_index(
        batch.req_to_token, batch.req_pool_indices, batch.seq_lens, seq, batch.kv_pool.page_size, extend
    )


@dataclass
class FlashInferMetadata:
    """One step's plan: which wrapper every layer runs (filled by ``init_forward_metadata``)."""

    mode: ForwardMode
    wrapper: Any  # the planned flashinfer wrapper


@dataclass
class _GraphBuffers:
    """Static page lists shared by the graph-mode decode wrappers (one per captured size)."""

    kv_indptr: torch.Tensor  # [max_bs + 1] int32
    kv_indices: torch.Tensor  # [max_bs * pages per request at most] int32
    kv_last_page_len: torch.Tensor  # [max_bs] int32
    wrappers: dict[int, Any] = field(default_factory=dict)


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


class FlashInferAttention(AttentionBackend):
    """FlashInfer's paged-KV attention: ``BatchPrefillWithPagedKVCacheWrapper``
    (causal) for extend, ``BatchDecodeWithPagedKVCacheWrapper`` for decode, both
    planned once per step over one workspace buffer. Preferred over ``triton``
    where usable; float32 models (and other head sizes) fall back to ``triton``.

    The softmax scale is a layer property the step's plan does not know, so plans
    use scale 1 and each layer passes its ``scaling`` as FlashInfer's ``q_scale``
    (which multiplies the planned scale).
    """

    name = "flashinfer"
    priority = 20

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        from radixserve_cuda import CudaPlatform

        reasons = attention_feature_reasons(query, cls.name)
        if not flashinfer_installed():
            reasons.append(f"flashinfer is not installed ({INSTALL_HINT})")
        if query.device != "cuda":
            reasons.append(f"FlashInfer runs on the cuda device, not {query.device!r}")
        reasons += CudaPlatform.unavailable_reasons()
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        if query.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {query.dtype} is not supported ({names} are)")
        if query.kv_dtype is not None and query.kv_dtype != query.dtype:
            reasons.append(f"KV cache dtype {query.kv_dtype} differs from the model dtype {query.dtype}")
        if query.head_dim is not None and query.head_dim not in SUPPORTED_HEAD_DIMS:
            dims = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
            reasons.append(f"head_dim {query.head_dim} is not supported ({dims} are)")
        if query.num_heads is not None and query.num_kv_heads and query.num_heads % query.num_kv_heads:
            reasons.append(f"num_heads {query.num_heads} is not a multiple of num_kv_heads {query.num_kv_heads}")
        return reasons

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        try:
            import flashinfer
        except ImportError as exc:
            raise RuntimeError(f"the flashinfer attention backend needs flashinfer ({INSTALL_HINT}): {exc}") from exc
        self._flashinfer = flashinfer
        self._workspace: torch.Tensor | None = None
        self._prefill: Any = None  # flashinfer's wrappers, made on first use
        self._decode: Any = None
        group = (query.num_heads or 1) // (query.num_kv_heads or 1)
        self._decode_tensor_cores = group not in CUDA_CORE_DECODE_GROUPS
        self._graph: _GraphBuffers | None = None
        self._planned: torch.cuda.Event | None = None  # after the last plan's copies to the device

    # -- wrappers -----------------------------------------------------------

    def _wrappers(self, device: torch.device) -> tuple[Any, Any]:
        """The prefill and decode wrappers, made on first use on ``device`` with one
        shared workspace; the kernels are warmed up then."""
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            fi = self._flashinfer
            self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=self._decode_tensor_cores
            )
            self._warm_up(device)
        return self._prefill, self._decode

    def _plan(
        self,
        mode: ForwardMode,
        index: PagedKVIndex,
        device: torch.device,
        page_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> Any:
        prefill, decode = self._wrappers(device)
        if mode is ForwardMode.DECODE:
            self._plan_decode(decode, index, page_size, num_heads, num_kv_heads, head_dim, dtype, kv_dtype)
            return decode
        self._before_plan()
        prefill.plan(
            index.qo_indptr,
            index.kv_indptr,
            index.kv_indices,
            index.kv_last_page_len,
            num_heads,
            num_kv_heads,
            head_dim,
            page_size,
            causal=True,
            q_data_type=dtype,
            kv_data_type=kv_dtype,
            sm_scale=1.0,
        )
        self._after_plan()
        return prefill

    def _plan_decode(
        self,
        wrapper: Any,
        index: PagedKVIndex,
        page_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> None:
        self._before_plan()
        wrapper.plan(
            index.kv_indptr,
            index.kv_indices,
            index.kv_last_page_len,
            num_heads,
            num_kv_heads,
            head_dim,
            page_size,
            q_data_type=dtype,
            kv_data_type=kv_dtype,
            sm_scale=1.0,
        )
        self._after_plan()

    # A plan writes its scheduling arrays into the wrapper's page-locked host buffer
    # and queues their copy to the device. With overlap scheduling the host plans
    # the next step while the device may not have reached this one's copy yet, so a
    # plan first waits for the previous plan's copy (it has almost always run).

    def _before_plan(self) -> None:
        if self._planned is not None:
            self._planned.synchronize()

    def _after_plan(self) -> None:
        self._planned = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        self._planned.record()

    # -- the backend interface -----------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = self._metadata(batch)

    def _shape(self) -> tuple[int, int, int]:
        """The query's ``num_heads``, ``num_kv_heads`` and ``head_dim`` (an attention query has them)."""
        q = self.query
        assert q.num_heads is not None and q.num_kv_heads is not None and q.head_dim is not None
        return q.num_heads, q.num_kv_heads, q.head_dim

    def _metadata(self, batch: ForwardBatch) -> FlashInferMetadata:
        q, pool = self.query, batch.kv_pool
        heads, kv_heads, head_dim = self._shape()
        index = batch_paged_kv_index(batch)
        wrapper = self._plan(
            batch.mode, index, pool.device, pool.page_size, heads, kv_heads, head_dim, q.dtype, pool.dtype
        )
        return FlashInferMetadata(batch.mode, wrapper)

    def _run(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta = batch.attn_metadata
        if not isinstance(meta, FlashInferMetadata) or meta.mode is not batch.mode:
            meta = batch.attn_metadata = self._metadata(batch)
        paged = batch.kv_pool.get_kv_pages(layer.layer_id)  # NHD: [pages, page_size, kv_heads, head_dim]
        out: torch.Tensor = meta.wrapper.run(q.contiguous(), paged, q_scale=layer.scaling)
        return out

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self._run(q, layer, batch)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self._run(q, layer, batch)

    # -- graph capture (decode) ------------------------------------------------
    #
    # FlashInfer's graph-mode decode wrapper is fixed to one batch size and reads
    # its page lists from buffers given at construction; ``plan`` (host work: it
    # splits the KV into chunks from the host page counts) refills them and the
    # wrapper's own scheduling arrays in place, so a graph captured on a wrapper
    # replays correctly after each re-plan. One wrapper per captured size, all
    # over views of one set of buffers and the shared workspace.

    def graph_unsupported_reasons(self, max_bs: int, max_context: int) -> list[str]:
        return []

    def init_graph_state(self, max_bs: int, max_context: int, device: torch.device) -> None:
        ps = self.query.page_size
        self._wrappers(device)
        self._graph = _GraphBuffers(
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(max_bs * -(-max_context // ps), dtype=torch.int32, device=device),
            kv_last_page_len=torch.ones(max_bs, dtype=torch.int32, device=device),
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        if self._graph is None:
            raise RuntimeError("init_graph_state must run before a graph is captured")
        bs, g = batch.batch_size, self._graph
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self._decode_tensor_cores,
            paged_kv_indptr_buffer=g.kv_indptr[: bs + 1],
            paged_kv_indices_buffer=g.kv_indices,
            paged_kv_last_page_len_buffer=g.kv_last_page_len[:bs],
        )
        g.wrappers[bs] = wrapper
        # What the capture runs on does not matter (replays re-plan): one token
        # per request, on the reserved page 0.
        index = PagedKVIndex(
            kv_indptr=torch.arange(bs + 1, dtype=torch.int32),
            kv_indices=torch.zeros(bs, dtype=torch.int32, device=g.kv_indices.device),
            kv_last_page_len=torch.ones(bs, dtype=torch.int32),
        )
        self._plan_graph(wrapper, index, batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        wrapper = self._graph.wrappers[bs] if self._graph is not None else None
        if wrapper is None:
            raise RuntimeError(f"no graph was captured for batch size {bs}")
        seq = list(batch.seq_lens_cpu)  # the graph runner's host copy, padding rows included
        index = build_paged_kv_index(
            batch.req_to_token, batch.req_pool_indices, batch.seq_lens, seq, batch.kv_pool.page_size
        )
        self._plan_graph(wrapper, index, batch)

    def _plan_graph(self, wrapper: Any, index: PagedKVIndex, batch: ForwardBatch) -> None:
        q, pool = self.query, batch.kv_pool
        heads, kv_heads, head_dim = self._shape()
        self._plan_decode(wrapper, index, pool.page_size, heads, kv_heads, head_dim, q.dtype, pool.dtype)
        batch.attn_metadata = FlashInferMetadata(ForwardMode.DECODE, wrapper)

    # -- warm-up ---------------------------------------------------------------

    def _warm_up(self, device: torch.device) -> None:
        """JIT-compile (or load from FlashInfer's cache) both kernels for this model's
        shape, once per process, on the first step (the server's start-up warm-up
        generation) rather than inside a request, and log how long it took: the
        first compile on a machine takes minutes."""
        q, page_size = self.query, self.query.page_size
        heads, kv_heads, head_dim = self._shape()
        key = (q.dtype, heads, kv_heads, head_dim, page_size)
        if key in _warmed:
            return
        logger.info(
            "FlashInfer: preparing paged prefill and decode kernels (%s, %d/%d heads, head_dim %d); "
            "the first compile on a machine takes minutes, later starts load them from its cache",
            str(q.dtype).replace("torch.", ""),
            heads,
            kv_heads,
            head_dim,
        )
        start = time.perf_counter()
        # Two requests of up to 3 tokens, on pages 1 and 2 of a 3-page scratch cache.
        cache = torch.zeros((3, page_size, kv_heads, head_dim), dtype=q.dtype, device=device)
        req_to_token = torch.arange(page_size, 3 * page_size, device=device).view(2, page_size)
        rows = torch.arange(2, device=device)
        lens = [min(3, page_size)] * 2
        seq_lens = torch.tensor(lens, device=device)
        for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            extend = lens if mode is ForwardMode.EXTEND else [1, 1]
            index = build_paged_kv_index(req_to_token, rows, seq_lens, lens, page_size, extend)
            wrapper = self._plan(mode, index, device, page_size, heads, kv_heads, head_dim, q.dtype, q.dtype)
            tokens = sum(extend)
            x = torch.zeros((tokens, heads, head_dim), dtype=q.dtype, device=device)
            wrapper.run(x, (cache, cache), q_scale=head_dim**-0.5)
        torch.cuda.synchronize(device)
        _warmed.add(key)
        logger.info("FlashInfer: kernels ready in %.1f s", time.perf_counter() - start)
