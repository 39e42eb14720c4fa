"""RadixAttention prefix cache: a radix tree over token ids whose values are KV slots.

Only whole pages are stored: every node's key is a multiple of ``page_size``
tokens, so every match is page aligned and every node owns whole pages, which
it hands back to the allocator when evicted. A node's children are indexed by
their first page of token ids, so a lookup costs one dict probe per level.

A node is *protected* while its ``lock_ref`` is positive (a running request
reads its KV, or that of a descendant) and *evictable* otherwise; eviction
takes unlocked leaves in least-recently-used order.

Each cache namespace (cache/base.py) has a tree of its own, its root made on
first use; eviction and the sizes span them all.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

import torch

from radixserve.cache.base import MatchResult, PrefixCache
from radixserve.cache.memory_pool import PagedAllocator


@dataclass(eq=False)
class TreeNode:
    key: list[int]
    value: torch.Tensor  # int64 KV slots of ``key``, one per token
    parent: TreeNode | None  # None for the root only
    id: int  # creation order; breaks LRU ties deterministically
    last_access: int
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0


class RadixCache(PrefixCache):
    def __init__(self, allocator: PagedAllocator, page_size: int):
        if allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != allocator page size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count()
        self._ids = itertools.count()
        self._new_tree()

    def _new_tree(self) -> None:
        self._roots: dict[Hashable, TreeNode] = {}
        self._evictable = 0
        self._protected = 0

    def _root(self, namespace: Hashable) -> TreeNode:
        """The root of ``namespace``'s tree (a root has no parent, and is never locked or evicted)."""
        root = self._roots.get(namespace)
        if root is None:
            empty = torch.empty(0, dtype=torch.int64, device=self.allocator.device)
            root = TreeNode(key=[], value=empty, parent=None, id=next(self._ids), last_access=next(self._clock))
            self._roots[namespace] = root
        return root

    @property
    def root(self) -> TreeNode:
        """The root of the default namespace's tree."""
        return self._root(None)

    # ------------------------------------------------------------------ lookup

    def match_prefix(self, token_ids: list[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached page-aligned prefix in ``namespace``. A match ending inside a node splits
        it, so that ``last_node`` covers exactly the matched tokens and can be locked alone."""
        now = next(self._clock)
        root = self._root(namespace)
        node, pos, values = root, 0, []
        node.last_access = now
        while len(token_ids) - pos >= self.page_size:
            child = node.children.get(self._page(token_ids, pos))
            if child is None:
                break
            n = self._match_len(child.key, token_ids, pos, len(token_ids))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + n
        slots = torch.cat(values) if values else root.value
        return MatchResult(slots=slots, last_node=node)

    def cached_len(self, token_ids: list[int], namespace: Hashable = None) -> int:
        node, pos = self._roots.get(namespace), 0
        while node is not None and len(token_ids) - pos >= self.page_size:
            child = node.children.get(self._page(token_ids, pos))
            if child is None:
                break
            n = len(child.key)
            if child.key != token_ids[pos : pos + n]:
                return pos + self._match_len(child.key, token_ids, pos, len(token_ids))
            node, pos = child, pos + n
        return pos

    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: Hashable = None) -> int:
        """Store the page-aligned part of ``token_ids`` with ``slots`` (one per token) in
        ``namespace``. Returns how many leading tokens were already cached: the caller's
        slots for those are duplicates the tree did not take. The rest now belong to the tree."""
        if slots.numel() != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {slots.numel()} slots")
        end = len(token_ids) - len(token_ids) % self.page_size
        now = next(self._clock)
        node, pos = self._root(namespace), 0
        node.last_access = now
        while pos < end:
            page = self._page(token_ids, pos)
            child = node.children.get(page)
            if child is None:
                leaf = TreeNode(
                    key=token_ids[pos:end],
                    value=slots[pos:end].clone(),  # callers may pass a view of their req_to_token row
                    parent=node,
                    id=next(self._ids),
                    last_access=now,
                )
                node.children[page] = leaf
                self._evictable += end - pos
                return pos
            n = self._match_len(child.key, token_ids, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    def _page(self, token_ids: list[int], pos: int) -> tuple[int, ...]:
        return tuple(token_ids[pos : pos + self.page_size])

    def _match_len(self, key: list[int], token_ids: list[int], start: int, end: int) -> int:
        """Whole pages of ``key`` that equal ``token_ids[start:end]``, in tokens."""
        ps = self.page_size
        limit = min(len(key), end - start)
        limit -= limit % ps
        i = 0
        while i < limit and key[i : i + ps] == token_ids[start + i : start + i + ps]:
            i += ps
        return i

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut ``node`` after its first ``n`` tokens; returns the new upper half, which
        inherits the locks (every lock through ``node`` also passes through it)."""
        upper = TreeNode(
            key=node.key[:n],
            value=node.value[:n],
            parent=node.parent,
            id=next(self._ids),
            last_access=node.last_access,
            lock_ref=node.lock_ref,
        )
        cast(TreeNode, node.parent).children[self._page(node.key, 0)] = upper  # a match never splits the root
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        upper.children[self._page(node.key, 0)] = node
        return upper

    # ----------------------------------------------------------------- locking

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    # ---------------------------------------------------------- request level

    def cache_finished_req(
        self,
        token_ids: list[int],
        slots: torch.Tensor,
        last_node: TreeNode,
        num_cached: int,
        namespace: Hashable = None,
    ) -> None:
        aligned = self._insert_req(token_ids, slots, num_cached, namespace)
        self.allocator.free(slots[aligned:])  # the partial last page is never cached
        self.dec_lock_ref(last_node)

    def cache_unfinished_req(
        self,
        token_ids: list[int],
        slots: torch.Tensor,
        last_node: TreeNode,
        num_cached: int,
        namespace: Hashable = None,
    ) -> MatchResult:
        aligned = self._insert_req(token_ids, slots, num_cached, namespace)
        match = self.match_prefix(token_ids[:aligned], namespace)
        assert match.num_tokens == aligned, "nothing can evict between insert and match"
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(last_node)
        return match

    def _insert_req(self, token_ids: list[int], slots: torch.Tensor, num_cached: int, namespace: Hashable) -> int:
        """Insert a request's page-aligned tokens and free its slots the tree already had.
        Returns the aligned length. Slots ``[num_cached, present)`` are whole pages the
        request allocated itself (its cached prefix and its own pages are page aligned)."""
        if num_cached % self.page_size or num_cached > len(token_ids):
            raise ValueError(f"num_cached={num_cached} must be page aligned and <= {len(token_ids)} tokens")
        aligned = len(token_ids) - len(token_ids) % self.page_size
        present = self.insert(token_ids[:aligned], slots[:aligned], namespace)
        self.allocator.free(slots[num_cached:present])
        return aligned

    # ---------------------------------------------------------------- eviction

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until ``num_tokens`` are freed
        or nothing evictable is left. A parent whose children are all gone joins in."""
        return self._evict_from(self._nodes(), num_tokens)

    def drop_namespaces(self, which: Callable[[Hashable], bool]) -> int:
        roots = {namespace: root for namespace, root in self._roots.items() if which(namespace)}
        freed = self._evict_from(self._nodes(roots.values()), math.inf)
        for namespace, root in roots.items():
            if not root.children:
                del self._roots[namespace]
        return freed

    def _evict_from(self, nodes: Iterable[TreeNode], num_tokens: float) -> int:
        heap = [(n.last_access, n.id, n) for n in nodes if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.allocator.free(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            parent = cast(TreeNode, node.parent)  # a leaf, not the root
            del parent.children[self._page(node.key, 0)]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def reset(self) -> bool:
        if self._protected:
            return False
        for node in self._nodes():
            self.allocator.free(node.value)
        self._new_tree()
        return True

    # ------------------------------------------------------------------- sizes

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def lock_mismatch(self, pins: list[TreeNode | None]) -> str | None:
        expected: dict[int, int] = {}
        for node in pins:
            while node is not None and node.parent is not None:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in self._nodes():
            want = expected.pop(id(node), 0)
            if node.lock_ref != want:
                return f"node of {len(node.key)} tokens has lock_ref {node.lock_ref}, requests pin it {want} times"
        if expected:
            return f"{len(expected)} pinned nodes are no longer in the tree"
        return None

    def _nodes(self, roots: Iterable[TreeNode] | None = None) -> Iterator[TreeNode]:
        """Every node but the roots (of ``roots``, default all), parents before children."""
        roots = self._roots.values() if roots is None else roots
        stack = [child for root in roots for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        ps = self.page_size
        evictable = protected = 0
        pages: set[int] = set()
        for node in self._nodes():
            n = len(node.key)
            assert n > 0 and n % ps == 0, f"node key of {n} tokens is not whole pages"
            assert node.value.numel() == n, "key and value lengths differ"
            assert node.parent is not None, "node without a parent"
            assert node.parent.children.get(self._page(node.key, 0)) is node, "child indexed under the wrong page"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "child locked more than parent"
            rows = node.value.view(-1, ps)
            assert bool((rows - rows[:, :1] == torch.arange(ps, device=rows.device)).all()), "page not contiguous"
            assert bool((rows[:, 0] % ps == 0).all()), "page does not start on a page boundary"
            node_pages = (rows[:, 0] // ps).tolist()
            assert 0 not in node_pages, "reserved page 0 cached"
            assert pages.isdisjoint(node_pages) and len(set(node_pages)) == len(node_pages), "page cached twice"
            pages.update(node_pages)
            if node.lock_ref:
                protected += n
            else:
                evictable += n
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"tracked evictable/protected {self._evictable}/{self._protected}, tree has {evictable}/{protected}"
        )

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, nodes={sum(1 for _ in self._nodes())}, "
            f"evictable={self._evictable}, protected={self._protected})"
        )
