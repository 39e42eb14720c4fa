"""The router's guess at what each worker has cached: a radix tree over the text of the
requests it routed (characters, not tokens: the router does not tokenize). Each node
remembers which workers were sent a request through it and when. Two bounds keep it
small, least recently used text first out: each worker's credited characters
(``max_chars``, SGLang's per-worker ``--max-tree-size``) and all workers' together
(``max_total_chars``), so that the tree stays bounded as the fleet grows; past the
latter, the worker credited with the most is cut to its equal share. It is approximate
by design: a worker's own cache may have evicted what the tree still credits it with."""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from collections.abc import Callable


class _Node:
    __slots__ = ("edge", "children", "parent", "workers")

    def __init__(self, edge: str, parent: _Node | None):
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.workers: dict[str, float] = {}  # worker url -> last time a request went through here


class PrefixTree:
    def __init__(self, max_chars: int, max_total_chars: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.max_chars, self.clock = max_chars, clock
        self.max_total_chars = max_total_chars
        self.root = _Node("", None)
        self.chars: defaultdict[str, int] = defaultdict(int)  # per worker, the text it is credited with
        self.total_chars = 0  # sum(self.chars.values()): an upper bound of the text stored

    def match(self, text: str) -> dict[str, int]:
        """For each worker, how many leading characters of ``text`` it was sent before."""
        matched: dict[str, int] = {}
        node, depth = self.root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                break
            common = _common_prefix(child.edge, text, depth)
            for worker in child.workers:
                matched[worker] = depth + common
            if common < len(child.edge):
                break
            node, depth = child, depth + common
        return matched

    def insert(self, text: str, worker: str) -> None:
        """Credit ``worker`` with ``text``; forget its least recent text beyond ``max_chars``."""
        now = self.clock()
        node, depth = self.root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                child = _Node(text[depth:], node)
                node.children[text[depth]] = child
            else:
                common = _common_prefix(child.edge, text, depth)
                if common < len(child.edge):
                    child = self._split(child, common)
            if worker not in child.workers:
                self.chars[worker] += len(child.edge)
                self.total_chars += len(child.edge)
            child.workers[worker] = now
            node, depth = child, depth + len(child.edge)
        if self.chars[worker] > self.max_chars:
            self._evict(worker, int(self.max_chars * 0.9))
        if self.max_total_chars is not None and self.total_chars > self.max_total_chars:
            self._evict_largest(self.max_total_chars)

    def _evict_largest(self, bound: int) -> None:
        """Cut the workers credited with the most to their equal share of 0.9 ``bound``
        until all of them together hold at most ``bound``."""
        while self.total_chars > bound:
            largest = max(self.chars, key=self.chars.__getitem__)
            before = self.total_chars
            self._evict(largest, int(bound * 0.9 / len(self.chars)))
            if self.total_chars == before:  # nothing left to take off it
                break

    def remove_worker(self, worker: str) -> None:
        self._evict(worker, 0)
        self.chars.pop(worker, None)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge at ``at``: the new upper node keeps the first part."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:at], parent)
        upper.workers = dict(child.workers)  # each worker's count is unchanged: the edge is only cut in two
        parent.children[upper.edge[0]] = upper
        child.edge, child.parent = child.edge[at:], upper
        upper.children[child.edge[0]] = child
        return upper

    def _evict(self, worker: str, target: int) -> None:
        """Take ``worker`` off its least recently used leaves until it holds ``target`` chars."""
        leaves = [(n.workers[worker], id(n), n) for n in self._nodes_of(worker) if not _has_child_with(n, worker)]
        heapq.heapify(leaves)
        while leaves and self.chars[worker] > target:
            _, _, node = heapq.heappop(leaves)
            del node.workers[worker]
            self.chars[worker] -= len(node.edge)
            self.total_chars -= len(node.edge)
            parent = node.parent
            if not node.workers and not node.children and parent is not None:
                del parent.children[node.edge[0]]
            if parent is not None and parent is not self.root and not _has_child_with(parent, worker):
                heapq.heappush(leaves, (parent.workers[worker], id(parent), parent))

    def _nodes_of(self, worker: str) -> list[_Node]:
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if worker in node.workers:
                found.append(node)
                stack.extend(node.children.values())
        return found


def _common_prefix(edge: str, text: str, start: int) -> int:
    """The length of the common prefix of ``edge`` and ``text[start:]``, by binary search
    over C-level comparisons (prompts run to tens of thousands of characters)."""
    if text.startswith(edge, start):
        return len(edge)
    low, high = 0, min(len(edge), len(text) - start)  # edge[:low] matches; edge[:high + 1] does not
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(edge[:mid], start):
            low = mid
        else:
            high = mid - 1
    return low


def _has_child_with(node: _Node, worker: str) -> bool:
    return any(worker in child.workers for child in node.children.values())
