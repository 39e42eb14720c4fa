"""A simulated worker's prefix cache: a radix cache over full blocks of tokens.

A block is known by a key that hashes its tokens and every token before it
(``workload.block_keys``), so a prompt's cached prefix is the run of its leading keys
the cache holds, and two prompts share a block exactly when they share everything up
to its end. Blocks that running requests read are locked; the others are evicted least
recently used first. Locking and unlocking walk a prompt's path from its end back to
the root, so a block is always more recently used than the blocks after it: the least
recently used block never has a cached child, and eviction takes leaves first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._refs: dict[int, int] = {}  # block key -> running requests that read it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unlocked blocks, least recent first

    @property
    def tokens(self) -> int:
        return len(self._refs) * self.block_size

    @property
    def evictable_tokens(self) -> int:
        return len(self._evictable) * self.block_size

    def match(self, keys: Sequence[int]) -> int:
        """How many of ``keys``' leading blocks are cached."""
        for i, key in enumerate(keys):
            if key not in self._refs:
                return i
        return len(keys)

    def lock(self, keys: Sequence[int]) -> int:
        """Hold ``keys`` (a path from the root) for a running request, adding the blocks not
        cached yet; the number added."""
        added = 0
        for key in reversed(keys):
            refs = self._refs.get(key)
            if refs is None:
                added += 1
                self._refs[key] = 1
            else:
                if refs == 0:
                    del self._evictable[key]
                self._refs[key] = refs + 1
        return added

    def unlock(self, keys: Sequence[int]) -> None:
        """A request that held ``keys`` ended; the blocks no request holds become
        evictable, as the most recently used."""
        for key in reversed(keys):
            refs = self._refs[key] - 1
            self._refs[key] = refs
            if refs == 0:
                self._evictable[key] = None

    def evict(self, tokens: int) -> int:
        """Free at least ``tokens`` by evicting unlocked blocks, least recent first, while
        there are any; the tokens freed."""
        freed = 0
        while freed < tokens and self._evictable:
            key, _ = self._evictable.popitem(last=False)
            del self._refs[key]
            freed += self.block_size
        return freed
