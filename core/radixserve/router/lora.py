"""LoRA adapters across the fleet: which adapter a request names, which workers may take
it, and loading it on the chosen worker when no candidate holds it.

A request names an adapter as a worker reads it (``server/lora.py``): by its OpenAI
``model`` (the adapter's name, or ``BASE:ADAPTER``) or by ``lora_path`` (which wins). The
router knows each worker's adapters from its ``/server_info`` (``WorkerFacts.lora``, read
again by the health loop) and remembers every adapter's path it has seen
(``Fleet.known_adapters``). Of the candidates the policy would consider:

- the workers holding the adapter, or loading it now, when there are some: the policy
  chooses among them;
- else, when its path is known, the workers serving LoRA that have not failed to load it
  lately (those with room under ``--max-loaded-loras`` first): the policy chooses, the
  router has the chosen one load it (``POST /load_lora_adapter``, one load per worker and
  adapter however many requests wait for it), then forwards;
- else the workers serving LoRA (or all): the worker answers, with its own 404 naming
  ``model`` or 400 naming ``lora_path`` when it does not have the adapter.

A load that fails is not asked of that worker again for ``LOAD_RETRY_AFTER_S``: the request
goes on, and the worker answers it as it can.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from radixserve.router.fleet import Fleet
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policies import RoutingRequest
from radixserve.router.request_info import RequestInfo
from radixserve.router.upstream import Upstream, UpstreamError
from radixserve.router.worker import LoRAFacts, Worker

logger = logging.getLogger("radixserve.router")

# Seconds after a failed load before the same worker is asked to load the same adapter again.
LOAD_RETRY_AFTER_S = 30.0
# A load reads the adapter's weights from disk on the worker: seconds, for a large one.
LOAD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Target:
    """What a request asks for: a served model (None: the fleet's one model) and the
    LoRA adapter over it (None: the model itself)."""

    model: str | None
    adapter: str | None


class AdapterRouting:
    """The fleet's adapters as routing sees them (the module's docstring), with the loads
    under way and those that failed lately, by worker and adapter."""

    def __init__(
        self, fleet: Fleet, upstream: Upstream, metrics: RouterMetrics, clock: Callable[[], float] = time.monotonic
    ):
        self.fleet, self.upstream, self.metrics, self.clock = fleet, upstream, metrics, clock
        self._loads: dict[tuple[str, str], asyncio.Future[None]] = {}  # (worker url, adapter) -> its load
        self._failed: dict[tuple[str, str], float] = {}  # (worker url, adapter) -> when its load failed

    def target(self, info: RequestInfo) -> Target:
        """The model and adapter ``info`` names. A ``model`` that is neither a served model,
        nor ``BASE:ADAPTER`` over one, nor an adapter a worker reported, is taken for an
        adapter of the one model served with LoRA (its worker answers for it); with none,
        or several, it stays as it is (the fleet answers 404)."""
        model, named = info.model, info.lora_path
        by_model = self.fleet.models()
        if model is None or model in by_model:
            return Target(model, named)
        for base in by_model:
            if model.startswith(base + ":"):
                return Target(base, named or model[len(base) + 1 :])
        known = self.fleet.known_adapters.get(model)
        if known is not None and known.model in by_model:
            return Target(known.model, named or model)
        with_lora = {w.model_id for w in self.fleet.workers.values() if w.facts.lora is not None}
        if len(with_lora) == 1:
            return Target(with_lora.pop(), named or model)
        return Target(model, named)

    @staticmethod
    def routing(request: RoutingRequest, adapter: str | None) -> RoutingRequest:
        """The request's routing text, keyed by its adapter: a worker caches each adapter's
        prefixes apart (and apart from the model's), so the prefix tree must too."""
        if adapter is None or not request.text:
            return request
        return replace(request, text=f"{adapter}\x1d{request.text}")

    def place(self, candidates: list[Worker], adapter: str | None) -> list[Worker]:
        """The candidates a request for ``adapter`` should go to (see the module's docstring)."""
        if adapter is None:
            return candidates
        holders = [w for w in candidates if w.facts.holds(adapter) or (w.url, adapter) in self._loads]
        if holders:
            return holders
        with_lora = [w for w in candidates if w.facts.lora is not None]
        known = adapter in self.fleet.known_adapters
        loaders = [w for w in with_lora if not self._failed_lately(w, adapter)] if known else []
        with_room = [w for w in loaders if w.facts.lora is not None and w.facts.lora.has_room()]
        return with_room or loaders or with_lora or candidates

    async def prepare(self, worker: Worker, adapter: str | None) -> None:
        """Have ``worker`` load ``adapter`` when it lacks it and can be asked to (its path is
        known, it serves LoRA, it has not failed to load it lately); a load already under
        way there is waited for, not repeated. Whatever the outcome, the request goes on."""
        if adapter is None or worker.facts.holds(adapter):
            return
        key = (worker.url, adapter)
        load = self._loads.get(key)
        if load is None:
            known = self.fleet.known_adapters.get(adapter)
            if known is None or worker.facts.lora is None or self._failed_lately(worker, adapter):
                return
            load = self._loads[key] = asyncio.ensure_future(self._load(worker, adapter, known.path))
            load.add_done_callback(lambda _: self._loads.pop(key, None))
        await asyncio.shield(load)  # a client that leaves does not end the load the others wait for

    def _failed_lately(self, worker: Worker, adapter: str) -> bool:
        failed = self._failed.get((worker.url, adapter))
        return failed is not None and self.clock() - failed < LOAD_RETRY_AFTER_S

    async def _load(self, worker: Worker, name: str, path: str) -> None:
        started = self.clock()
        try:
            reply = await self.upstream.post(
                worker.url + "/load_lora_adapter",
                headers=self.fleet.admin_headers,
                timeout_s=LOAD_TIMEOUT_S,
                body={"lora_name": name, "lora_path": path},
            )
        except UpstreamError as exc:
            self._load_failed(worker, name, str(exc))
            return
        answer = reply.json()
        if reply.status != 200:
            message = _error_message(answer) or reply.body[:200].decode(errors="replace")
            self._load_failed(worker, name, f"{reply.status}: {message}")
            await self.fleet.refresh_lora(worker)  # what it holds now (another router may have loaded it)
            return
        lora = worker.facts.lora or LoRAFacts()
        loaded = answer.get("loaded_adapters") if isinstance(answer, dict) else None
        adapters = loaded if isinstance(loaded, dict) else {**lora.adapters, name: path}
        self.fleet.record_lora(worker, replace(lora, adapters=adapters))
        self.metrics.adapter_loads.labels(worker.url, "loaded").inc()
        elapsed = self.clock() - started
        logger.info("worker %s loaded LoRA adapter %r from %s in %.2f s", worker.url, name, path, elapsed)

    def _load_failed(self, worker: Worker, name: str, detail: str) -> None:
        now = self.clock()
        self._failed = {key: at for key, at in self._failed.items() if now - at < LOAD_RETRY_AFTER_S}
        self._failed[(worker.url, name)] = now
        self.metrics.adapter_loads.labels(worker.url, "failed").inc()
        logger.warning(
            "worker %s did not load LoRA adapter %r (%s); not asked again for %.0f s",
            worker.url,
            name,
            detail,
            LOAD_RETRY_AFTER_S,
        )


def _error_message(answer: Any) -> str | None:
    """The message of an OpenAI error envelope."""
    error = answer.get("error") if isinstance(answer, dict) else None
    return error.get("message") if isinstance(error, dict) else None
