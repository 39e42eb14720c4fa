"""Paged KV memory: request->token table, per-layer KV buffers and the page allocator.

Slot 0..page_size-1 (page 0) is never handed out: padded positions may point at
it harmlessly. Everything else is owned by exactly one of: the free list, a
running request, or the radix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.transfer import HostCopy, HostTransfer


class ReqToTokenPool:
    """Per request row, position by position: the KV slot of each token
    (``req_to_token``) and the token id itself (``token_ids``). Both live on the
    device, so a step's inputs are gathered there by index, and a sampled token
    is written back there before the host ever looks at it."""

    def __init__(self, size: int, max_context_len: int, device: torch.device, transfer: HostTransfer | None = None):
        self.size = size
        self.transfer = transfer or HostTransfer(device)
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.token_ids = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, index: int) -> None:
        self._free.append(index)

    def write(self, index: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[index, start : start + slots.numel()] = slots

    def write_tokens(self, index: int, start: int, token_ids: list[int]) -> None:
        self.token_ids[index, start : start + len(token_ids)] = self.transfer.to_device(token_ids)

    def append_tokens(self, rows: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> None:
        """``token_ids[i]`` goes to row ``rows[i]`` at ``positions[i]``: one step's samples."""
        self.token_ids.index_put_((rows, positions), token_ids)


@dataclass(frozen=True)
class KVLayout:
    """How the KV pool lays out each layer's K and V buffer in memory. The attention
    backend declares the one it reads (``AttentionBackend.kv_layout``) and the
    runner builds the pool with it.

    Token-major (``head_major=False``, the default): ``[slots, kv_heads, head_dim]``
    with ``slot = page * page_size + offset``, the same memory as
    ``[num_pages + 1, page_size, kv_heads, head_dim]`` (pages of token rows, the
    "NHD" layout of paged-attention libraries). Head-major (``head_major=True``):
    ``[num_pages + 1, kv_heads, page_size, head_dim]``, each page holding one
    head's tokens contiguously ("HND", what some vendors' fused attention
    operators read). Slots and pages mean the same in both: only the order of
    the bytes inside a page differs, so the allocator and caches never see it.
    """

    head_major: bool = False


# Makes a zero-filled buffer of the pool: ``(shape, dtype, device) -> tensor``;
# the model runner passes its platform's ``pool_buffer``.
BufferAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class KVPool:
    """Per-layer K and V buffers of ``num_pages * page_size`` slots (page 0 reserved),
    laid out as ``layout`` says; ``allocate`` makes each (zero-filled)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: KVLayout = KVLayout(),
        allocate: BufferAllocator = _zeros,
    ):
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        self.layout = layout
        shape: tuple[int, ...]
        if layout.head_major:
            shape = (num_pages + 1, num_kv_heads, page_size, head_dim)
        else:
            shape = ((num_pages + 1) * page_size, num_kv_heads, head_dim)
        self.k_buffers = [allocate(shape, dtype, device) for _ in range(num_layers)]
        self.v_buffers = [allocate(shape, dtype, device) for _ in range(num_layers)]

    @property
    def size(self) -> int:
        """Usable token slots (excludes the reserved page)."""
        return self.num_pages * self.page_size

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V as ``[slots, kv_heads, head_dim]`` (token-major pools only)."""
        if self.layout.head_major:
            raise ValueError(
                "get_kv: this KV pool is head-major (KVLayout(head_major=True)); read it with get_kv_pages"
            )
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def get_kv_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V page by page, views of the buffers: token-major
        ``[num_pages + 1, page_size, kv_heads, head_dim]``, head-major
        ``[num_pages + 1, kv_heads, page_size, head_dim]``."""
        k, v = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if self.layout.head_major:
            return k, v
        shape = (self.num_pages + 1, self.page_size, *k.shape[1:])
        return k.view(shape), v.view(shape)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` at slots ``loc`` ``[n]``."""
        if self.layout.head_major:
            page, offset = loc // self.page_size, loc % self.page_size
            # [pages, kv_heads, page_size, d] indexed (page, :, offset) -> [n, kv_heads, d]
            self.k_buffers[layer_id][page, :, offset] = k.to(self.dtype)
            self.v_buffers[layer_id][page, :, offset] = v.to(self.dtype)
            return
        # index_copy_ is a plain scatter; ``buf[loc] = x`` goes through index_put
        # and costs milliseconds per call on CPU.
        self.k_buffers[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer_id].index_copy_(0, loc, v.to(self.dtype))

    def read_kv(
        self, layer_id: int, loc: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a layer's K and V ``[n, heads, head_dim]`` at slots ``loc`` ``[n]``,
        of the pool's heads ``[start, stop)`` (all when None), in either layout."""
        start, stop = heads or (0, self.k_buffers[layer_id].shape[-2])
        if self.layout.head_major:
            page, offset = loc // self.page_size, loc % self.page_size
            return (
                self.k_buffers[layer_id][page, start:stop, offset],
                self.v_buffers[layer_id][page, start:stop, offset],
            )
        k, v = self.k_buffers[layer_id].index_select(0, loc), self.v_buffers[layer_id].index_select(0, loc)
        return k[:, start:stop].contiguous(), v[:, start:stop].contiguous()

    def write_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_head: int = 0) -> None:
        """Store ``k``/``v`` ``[n, h, head_dim]`` at slots ``loc`` ``[n]`` into the pool's
        heads ``[first_head, first_head + h)``."""
        h = k.shape[1]
        if self.layout.head_major:
            page, offset = loc // self.page_size, loc % self.page_size
            self.k_buffers[layer_id][page, first_head : first_head + h, offset] = k.to(self.dtype)
            self.v_buffers[layer_id][page, first_head : first_head + h, offset] = v.to(self.dtype)
            return
        self.k_buffers[layer_id].narrow(1, first_head, h).index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer_id].narrow(1, first_head, h).index_copy_(0, loc, v.to(self.dtype))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class LatentKV:
    """The KV entry of multi-head latent attention (DeepSeek-V2's MLA), which a
    model states in its facts (``ModelFacts.mla``, then ``KernelQuery.mla``):
    per token and layer one entry that every head shares, the compressed latent
    ``c_kv`` (``kv_lora_rank`` values, already normalised) followed by the key's
    rotary part (``rope_dim`` values, already rotated), in place of a K and a V
    per KV head."""

    kv_lora_rank: int
    rope_dim: int

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


class LatentKVPool(KVPool):
    """The KV pool of a multi-head latent attention model: per layer one buffer
    ``[slots, latent.entry_dim]`` (each token's latent, then its rotary key part)
    and no K or V buffers. Slots, pages and the reserved page 0 mean what they
    mean in ``KVPool`` and the layout is token-major; the K/V accessors refuse,
    MLA backends read ``get_latent`` and write ``set_latent``."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        latent: LatentKV,
        dtype: torch.dtype,
        device: torch.device,
        allocate: BufferAllocator = _zeros,
    ):
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        self.layout = KVLayout()
        self.latent = latent
        shape = ((num_pages + 1) * page_size, latent.entry_dim)
        self.latent_buffers = [allocate(shape, dtype, device) for _ in range(num_layers)]
        self.k_buffers: list[torch.Tensor] = []
        self.v_buffers: list[torch.Tensor] = []

    def get_latent(self, layer_id: int) -> torch.Tensor:
        """A layer's entries ``[slots, kv_lora_rank + rope_dim]``."""
        return self.latent_buffers[layer_id]

    def set_latent(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Store ``latent`` ``[n, kv_lora_rank]`` and ``k_rope`` ``[n, rope_dim]`` at slots ``loc`` ``[n]``."""
        buf = self.latent_buffers[layer_id]
        buf.index_copy_(0, loc, torch.cat((latent, k_rope), dim=-1).to(self.dtype))

    def _no_kv(self) -> ValueError:
        return ValueError("this KV pool holds multi-head latent attention entries; read them with get_latent")

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._no_kv()

    def get_kv_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._no_kv()

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        raise self._no_kv()

    @staticmethod
    def entry_bytes_per_token(num_layers: int, latent: LatentKV, dtype: torch.dtype) -> int:
        return num_layers * latent.entry_dim * torch.empty((), dtype=dtype).element_size()


class PagedAllocator:
    """Hands out KV slots a page at a time; a request's pages are its own.

    ``alloc_slots`` continues each request in the unused tail of its last page
    before taking new pages, so a request's slots are page-contiguous and any
    page-aligned prefix of it can be shared through the radix cache.
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device, transfer: HostTransfer | None = None):
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        self.transfer = transfer or HostTransfer(device)
        self.clear()

    def clear(self) -> None:
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))
        self._pending: list[HostCopy] = []  # freed slots still on their way to the host

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    def available_size(self, wait: bool = False) -> int:
        """Free token slots (whole free pages only). Pages freed while the device
        still computes count once their slot ids reach the host; ``wait`` waits
        for them (only an exact count needs that)."""
        self._collect(wait)
        return len(self._free_pages) * self.page_size

    def free_page_ids(self) -> list[int]:
        """The free pages, the frees still on their way to the host included."""
        self._collect(wait=True)
        return list(self._free_pages)

    def pages_needed(self, prefix_lens: list[int], extend_lens: list[int]) -> int:
        ps = self.page_size
        if ps == 1:  # the common case, on every decode step: a page per token
            return sum(extend_lens)
        return sum(-(-(p + n) // ps) - (-(-p // ps)) for p, n in zip(prefix_lens, extend_lens, strict=True))

    def alloc_slots(self, prefix_lens: list[int], last_locs: list[int], extend_lens: list[int]) -> list[int] | None:
        """Slots for ``extend_lens[i]`` new tokens after ``prefix_lens[i]`` tokens whose
        last slot is ``last_locs[i]`` (ignored when the prefix is empty or page aligned),
        in request order, as host ints. Returns None, allocating nothing, when there
        are not enough free pages."""
        need = self.pages_needed(prefix_lens, extend_lens)
        if need > len(self._free_pages) and self._pending:
            self._collect(wait=True)
        if need > len(self._free_pages):
            return None
        ps = self.page_size
        if ps == 1:  # one page per token, taken from the end of the free list as below
            out = self._free_pages[len(self._free_pages) - need :][::-1]
            del self._free_pages[len(self._free_pages) - need :]
            return out
        out = []
        for prefix, last, n in zip(prefix_lens, last_locs, extend_lens, strict=True):
            in_page = prefix % ps
            if in_page:
                take = min(n, ps - in_page)
                out.extend(range(last + 1, last + 1 + take))
                n -= take
            while n > 0:
                page = self._free_pages.pop()
                take = min(n, ps)
                out.extend(range(page * ps, page * ps + take))
                n -= take
        return out

    def undo_alloc(self, prefix_lens: list[int], extend_lens: list[int], slots: list[int]) -> None:
        """Give back the pages that ``alloc_slots(prefix_lens, _, extend_lens)`` took
        for ``slots`` (those past each request's last partly used page), where they
        were in the free list."""
        ps, taken, start = self.page_size, {}, 0  # dict: the pages in the order they were taken
        for prefix, n in zip(prefix_lens, extend_lens, strict=True):
            in_page = min(n, (ps - prefix % ps) % ps)  # the slots that continue the last page
            taken.update(dict.fromkeys(slot // ps for slot in slots[start + in_page : start + n]))
            start += n
        self._free_pages.extend(reversed(taken))

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages that ``slots`` lie on. Callers pass whole ownership: every
        slot of a request's page that is not shared with the cache. The slot ids
        come to the host without waiting for the device (radixserve/transfer.py)."""
        if slots.numel() == 0:
            return
        self._pending.append(self.transfer.to_host(slots))
        self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        """Move the pages of the frees whose slot ids have landed to the free list."""
        waiting = []
        for copy in self._pending:
            if wait or copy.ready():
                (slots,) = copy.wait()
                self._free_pages.extend(torch.unique(slots // self.page_size).tolist())
            else:
                waiting.append(copy)
        self._pending = waiting
