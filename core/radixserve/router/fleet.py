"""The fleet: the workers the router routes to, how they join and leave, and the two
background loops that keep their state (health checks, load reads).

A worker joins once it answers ``/v1/models``; until then it is *pending* and the health
loop keeps trying (a worker still loading its model answers 503). At registration the
router reads ``/model_info`` and ``/server_info`` (SGLang's names; the ``worker`` facts
radixserve adds there say what it can do). A worker whose model has the name of another
worker's and a different identity (architecture, vocabulary) is refused.

A worker's LoRA adapters change while it serves (loads, unloads, a restart): the health
loop reads them again from ``/server_info`` with every check of a worker serving LoRA, and
the fleet remembers every adapter's path it has seen, so that it can load one again
where none holds it (``lora.AdapterRouting``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from radixserve.router.args import RouterArgs, normalize_url
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policies import Policy
from radixserve.router.upstream import Upstream, UpstreamError
from radixserve.router.worker import CircuitBreaker, LoRAFacts, Worker, WorkerFacts, WorkerLoad
from radixserve.server.errors import APIError

logger = logging.getLogger("radixserve.router")

_IDENTITY_KEYS = ("architecture", "vocab_size")


class WorkerNotReady(Exception):
    """The worker does not serve yet (unreachable, or still starting)."""


@dataclass(frozen=True)
class KnownAdapter:
    """A LoRA adapter as a worker reported it: the model it adapts and where it is read from."""

    model: str
    path: str


class Fleet:
    """``policies``: every policy object routing over this fleet (each forgets a worker
    that leaves). With ``--pd-disaggregation`` the ``--prefill`` and ``--decode`` workers
    have those roles; the others (``--worker-urls``, ``POST /workers``) have none."""

    def __init__(self, args: RouterArgs, upstream: Upstream, policies: list[Policy], metrics: RouterMetrics):
        self.args, self.upstream, self.policies, self.metrics = args, upstream, policies, metrics
        self.workers: dict[str, Worker] = {}
        self.bootstrap_ports = args.prefill_bootstrap_ports
        self.roles = {url: "prefill" for url in self.bootstrap_ports} | {url: "decode" for url in args.decode}
        self.pending: set[str] = set(args.worker_urls) | set(self.roles)
        self.no_load_report: set[str] = set()
        # Every adapter a worker has reported, by name (the latest report's), kept after it is unloaded.
        self.known_adapters: dict[str, KnownAdapter] = {}
        self._by_model: dict[str, list[Worker]] | None = None  # models()'s answer until the membership changes
        admin_key = args.worker_admin_api_key or args.worker_api_key
        self.headers = {"Authorization": f"Bearer {args.worker_api_key}"} if args.worker_api_key else {}
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    # ---- membership ------------------------------------------------------------------
    async def add(self, url: str) -> Worker | None:
        """Register ``url`` now, or keep it pending (None) when it does not serve yet;
        APIError 409 when its model conflicts with the fleet's."""
        url = normalize_url(url)
        if url in self.workers:
            return self.workers[url]
        try:
            facts = await self._read_facts(url)
        except WorkerNotReady as exc:
            level = logging.DEBUG if url in self.pending else logging.INFO
            self.pending.add(url)
            logger.log(level, "worker %s is pending (retried every health check): %s", url, exc)
            return None
        self._check_identity(url, facts)
        self.pending.discard(url)
        worker = Worker(
            url,
            facts,
            CircuitBreaker(
                self.args.cb_failure_threshold, self.args.cb_success_threshold, self.args.cb_timeout_duration_secs
            ),
        )
        self.workers[url] = worker
        self._by_model = None
        self._learn_adapters(worker)
        self.metrics.worker_joined(worker)
        logger.info(
            "worker %s joined: model %s, device %s, backends %s", url, facts.model_id, facts.device, facts.backends
        )
        return worker

    def remove(self, url: str) -> bool:
        url = normalize_url(url)
        self.pending.discard(url)
        worker = self.workers.pop(url, None)
        if worker is None:
            return False
        self._by_model = None
        for policy in self.policies:
            policy.forget(url)
        self.metrics.worker_left(worker)
        logger.info("worker %s removed", url)
        return True

    def models(self) -> dict[str, list[Worker]]:
        """The workers of each model (not to be changed: it is kept until the membership changes)."""
        if self._by_model is None:
            self._by_model = {}
            for worker in self.workers.values():
                self._by_model.setdefault(worker.model_id, []).append(worker)
        return self._by_model

    # ---- LoRA adapters -----------------------------------------------------------------
    def held_adapters(self) -> dict[str, KnownAdapter]:
        """The adapters some worker holds now, by name."""
        return {
            name: KnownAdapter(worker.model_id, path)
            for worker in self.workers.values()
            if worker.facts.lora is not None
            for name, path in worker.facts.lora.adapters.items()
        }

    def record_lora(self, worker: Worker, lora: LoRAFacts) -> None:
        """The router changed the worker's adapters (it loaded one there)."""
        worker.set_lora(lora)
        self._learn_adapters(worker)

    async def refresh_lora(self, worker: Worker) -> None:
        """Read the worker's adapters again (a worker that does not report them keeps what it had)."""
        revision = worker.facts_revision
        try:
            info = await self._get_json(worker.url, "/server_info")
        except WorkerNotReady:
            return
        facts = info.get("worker") if isinstance(info, dict) else None
        if isinstance(facts, dict) and "lora" in facts and worker.set_lora(LoRAFacts.of(facts["lora"]), revision):
            self._learn_adapters(worker)

    def _learn_adapters(self, worker: Worker) -> None:
        if worker.facts.lora is not None:
            for name, path in worker.facts.lora.adapters.items():
                self.known_adapters[name] = KnownAdapter(worker.model_id, path)

    # ---- routing -----------------------------------------------------------------------
    def candidates(
        self, model: str | None, needs: dict[str, str], exclude: set[str], role: str | None = None
    ) -> list[Worker]:
        """The workers (of ``role``, prefill or decode, when given) that may take a request
        now; an APIError saying why when none may."""
        serving = self._serving(model)
        if role is not None:
            serving = [w for w in serving if self.roles.get(w.url) == role]
            if not serving:
                raise APIError(503, f"no {role} worker serves model {model!r}", code="no_worker_available")
        for feature, param in needs.items():
            serving = [w for w in serving if w.facts.supports(feature)]
            if not serving:
                raise APIError(
                    400,
                    f"{param}: no worker serving model {model!r} supports {feature.replace('_', ' ')}",
                    param=param,
                )
        available = [w for w in serving if w.available()]
        fresh = [w for w in available if w.url not in exclude]
        if fresh:
            return fresh
        if available:  # every worker was tried: try them again rather than fail
            return available
        raise APIError(503, f"no healthy worker serves model {model!r} now; retry later", code="no_worker_available")

    def bootstrap_of(self, worker: Worker) -> tuple[str, int]:
        """Where a prefill worker's bootstrap listener is: its host and bootstrap port
        (``--prefill URL PORT``, else the one it reports)."""
        port = self.bootstrap_ports.get(worker.url) or worker.facts.bootstrap_port
        if port is None:
            raise APIError(
                503, f"prefill worker {worker.url} reports no bootstrap port; give it with --prefill URL PORT"
            )
        host = urlsplit(worker.url).hostname
        assert host is not None  # a normalized worker URL names its host
        return host, port

    def _serving(self, model: str | None) -> list[Worker]:
        by_model = self.models()
        if model is None:  # /generate names no model: any worker, when the fleet serves one model
            if len(by_model) == 1:
                return next(iter(by_model.values()))
            raise APIError(400, f"model: required when the router serves several models ({sorted(by_model)})")
        if model not in by_model:
            served = ", ".join(sorted(by_model)) or "none yet"
            raise APIError(
                404, f"model {model!r} is not served here (served: {served})", param="model", code="model_not_found"
            )
        return by_model[model]

    # ---- background loops --------------------------------------------------------------
    async def run_health_checks(self) -> None:
        while True:
            await asyncio.gather(*(self._join_pending(url) for url in list(self.pending)))
            await asyncio.gather(*(self._check_health(w) for w in list(self.workers.values())))
            await asyncio.sleep(self.args.health_check_interval_secs)

    async def run_load_reads(self) -> None:
        while True:
            workers = [w for w in self.workers.values() if w.healthy and w.url not in self.no_load_report]
            await asyncio.gather(*(self._read_load(w) for w in workers))
            await asyncio.sleep(self.args.load_poll_interval_secs)

    async def _join_pending(self, url: str) -> None:
        try:
            await self.add(url)
        except APIError as exc:  # a model conflict does not go away by retrying
            self.pending.discard(url)
            logger.error("worker %s not added: %s", url, exc.message)

    async def _check_health(self, worker: Worker) -> None:
        try:
            reply = await self.upstream.get(
                worker.url + "/health", headers=self.headers, timeout_s=self.args.health_check_timeout_secs
            )
            ok = reply.status == 200
        except UpstreamError as exc:
            if exc.timed_out and worker.in_flight:  # busy: a long prefill step can hold its /health
                logger.debug("worker %s is slow to answer its health check while serving; not counted", worker.url)
                return
            ok = False
        if ok:
            worker.health_failures, worker.health_successes = 0, worker.health_successes + 1
            rejoined = not worker.healthy and worker.health_successes >= self.args.health_success_threshold
            if rejoined:
                self._rejoin(worker)
            if rejoined or worker.facts.lora is not None:  # a restarted worker holds only its --lora-paths
                await self.refresh_lora(worker)
        else:
            worker.health_successes, worker.health_failures = 0, worker.health_failures + 1
            if worker.healthy and worker.health_failures >= self.args.health_failure_threshold:
                worker.healthy = False
                logger.warning("worker %s is unhealthy (%d failed health checks)", worker.url, worker.health_failures)
        self.metrics.worker_state(worker)

    def _rejoin(self, worker: Worker) -> None:
        """Serving again (after a restart, its cache is empty): traffic at once, no cache credit."""
        worker.healthy = True
        worker.breaker.reset()
        worker.forget_load()
        for policy in self.policies:
            policy.forget(worker.url)
        logger.info("worker %s is healthy again", worker.url)

    async def _read_load(self, worker: Worker) -> None:
        try:
            reply = await self.upstream.get(worker.url + "/get_load", headers=self.headers, timeout_s=5)
        except UpstreamError:
            return
        if reply.status == 404:
            self.no_load_report.add(worker.url)  # not every OpenAI server reports it
            return
        body = reply.json() if reply.status == 200 else None
        entries = body if isinstance(body, list) else [body] if isinstance(body, dict) else None
        if entries is not None:
            worker.observe(WorkerLoad.of(entries))

    # ---- registration ------------------------------------------------------------------
    async def _read_facts(self, url: str) -> WorkerFacts:
        models = await self._get_json(url, "/v1/models", required=True)
        cards = models.get("data") if isinstance(models, dict) else None
        if not cards:
            raise WorkerNotReady("/v1/models lists no model")
        base = next((card for card in cards if not card.get("parent")), cards[0])  # not a LoRA adapter's card
        model_info = await self._get_json(url, "/model_info") or await self._get_json(url, "/get_model_info") or {}
        server_info = await self._get_json(url, "/server_info") or await self._get_json(url, "/get_server_info") or {}
        facts: dict[str, Any] = server_info.get("worker") or {}
        return WorkerFacts(
            model_id=base["id"],
            identity=tuple((key, model_info[key]) for key in _IDENTITY_KEYS if key in model_info),
            device=facts.get("device"),
            dtype=facts.get("dtype"),
            backends=facts.get("backends") or {},
            max_total_num_tokens=facts.get("max_total_num_tokens"),
            max_running_requests=facts.get("max_running_requests"),
            prefill_step_tokens=facts.get("prefill_step_tokens"),
            features=facts.get("features") or {},
            disaggregation_mode=server_info.get("disaggregation_mode") or "null",
            bootstrap_port=server_info.get("disaggregation_bootstrap_port"),
            lora=LoRAFacts.of(facts.get("lora")),
            speculative=_algorithm(facts.get("speculative")),
        )

    async def _get_json(self, url: str, path: str, required: bool = False) -> Any:
        try:
            reply = await self.upstream.get(url + path, headers=self.headers, timeout_s=10)
        except UpstreamError as exc:
            raise WorkerNotReady(f"{path}: {exc}") from None
        if reply.status != 200:
            if required:
                raise WorkerNotReady(f"{path} answered {reply.status}")
            return None
        return reply.json()

    def _check_identity(self, url: str, facts: WorkerFacts) -> None:
        for other in self.workers.values():
            same_name = other.model_id == facts.model_id and other.facts.identity and facts.identity
            if same_name and dict(other.facts.identity) != dict(facts.identity):
                raise APIError(
                    409,
                    f"worker {url} serves a different model under the name {facts.model_id!r} "
                    f"({dict(facts.identity)}; {other.url} has {dict(other.facts.identity)}): refused",
                    param="url",
                    code="model_conflict",
                )


def _algorithm(speculative: Any) -> str | None:
    """The speculative decoding algorithm a worker's facts name (None: off, or not said)."""
    algorithm = speculative.get("algorithm") if isinstance(speculative, dict) else None
    return algorithm if isinstance(algorithm, str) else None
