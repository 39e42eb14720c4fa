"""Grammar compilation off the scheduler loop: a thread pool, the backend built
on first use, and a cache of compiled grammars keyed by (backend, spec).

The cache holds futures, so a spec asked for again while it compiles waits for
the same compile, and a spec that failed fails again at once (the error is
cached like a success). The backend is built in a worker thread too: it loads
the model's tokenizer (the first grammar request pays for it, no other request
does) and reads the whole vocabulary.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from radixserve.structured_output.backend import CompiledGrammar, GrammarBackend, GrammarSpec, GrammarTokenizer

CACHE_ENTRIES = 512
COMPILE_THREADS = 2


class GrammarCompiler:
    def __init__(self, backend_cls: type[GrammarBackend], load_tokenizer: Callable[[], GrammarTokenizer]):
        self.backend_cls = backend_cls
        self._load_tokenizer = load_tokenizer
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str, str], Future[CompiledGrammar]] = OrderedDict()

    @property
    def name(self) -> str:
        return self.backend_cls.name

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The compile of ``spec``: cached, running, or started now."""
        key = (self.name, spec.kind, spec.text)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._cache[key] = self._pool.submit(self._compile, spec)
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)  # a running compile still completes for whoever waits on it
        return future

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self.backend_cls(self._load_tokenizer())
        return self._backend.compile(spec)
