"""Builds the model on the selected platform and backends, owns the KV memory,
and runs one forward per step."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

import torch

from radixserve.backend_timing import AgreedSelection
from radixserve.cache.memory_pool import KVPool, LatentKVPool, PagedAllocator, ReqToTokenPool
from radixserve.checkpoints.embedding import embedding_config
from radixserve.checkpoints.loader import load_model
from radixserve.config import ServerArgs
from radixserve.forward_batch import ForwardBatch
from radixserve.layers.context import BackendSelector, ModelContext
from radixserve.layers.rotary import LongRope
from radixserve.registry import PluginRegistry
from radixserve.runtime.execution.distributed import RankSpec, join_group
from radixserve.runtime.execution.graph_runner import GraphRunner
from radixserve.runtime.execution.lora_adapters import LoRAAdapters
from radixserve.runtime.execution.model_plan import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    ModelPlan,
    choose_backends,
    plan_model,
)
from radixserve.transfer import HostTransfer

logger = logging.getLogger(__name__)


def _same_name(name: str) -> tuple[str, Any] | None:
    """A model without its own checkpoint mapping: every tensor's name is its parameter's."""
    return name, None


def kv_pool_tokens(
    total_bytes: int, free_bytes: int, weight_bytes: int, fraction: float, bytes_per_token: int, max_tokens: int
) -> int:
    """KV pool size in tokens from the memory the platform reports, measured after
    the weights are loaded: ``fraction`` of the device's total memory less the
    weights, but at most 90% of what is free now (other processes may hold some),
    and no more than ``max_tokens`` (every running request at full context)."""
    budget = min(total_bytes * fraction - weight_bytes, free_bytes * 0.9)
    return int(max(0, min(budget // bytes_per_token, max_tokens)))


class ModelRunner:
    """One tensor-parallel rank's model and KV memory, built from the model plan
    (``model_plan.py``) made before the ranks started. With ``rank`` (tp_size > 1)
    it joins its group first; rank 0 chooses the backends (``choose_backends``)
    and every rank takes rank 0's completed plan. A rank built without a plan (the
    ranks of other nodes, or a runner built directly) gets rank 0's, which rank 0
    makes itself if it has none. The KV pool is the smallest any rank can hold."""

    def __init__(
        self,
        args: ServerArgs,
        model_path: str,
        registry: PluginRegistry,
        rank: RankSpec | None = None,
        plan: ModelPlan | None = None,
    ):
        self.args = args
        self.registry = registry
        self.platform = registry.resolve_platform(args.device)()
        self.group = join_group(rank, self.platform)
        if self.group.size != args.tp_size:
            raise ValueError(f"tp_size: {args.tp_size}, but this rank joined a group of {self.group.size}")
        self.gpu_id = args.base_gpu_id + self.group.local_rank  # the platform's device index of this rank
        self.device = self.platform.device(self.gpu_id)
        self.platform.bind_device(self.device)
        self.transfer = HostTransfer(self.device, self.platform.pinned_host_staging)
        if self.group.is_leader:
            plan = plan or plan_model(args, model_path, type(self.platform))
            plan.check_device(self.platform)
            plan = choose_backends(plan, args, registry, self.platform, self.gpu_id)
        if self.group.size > 1:
            plan = self.group.broadcast(plan if self.group.is_leader else None)
        assert plan is not None  # rank 0's, which it always has
        if not self.group.is_leader:
            plan.check_device(self.platform)
        self.plan = plan
        hf_config = plan.hf_config
        self.num_layers = hf_config.num_hidden_layers
        self.vocab_size = hf_config.vocab_size
        self.query = plan.query
        self.dtype, self.kv_dtype = plan.dtype, plan.kv_dtype
        self.dtype_reason = plan.dtype_choice.reason
        self.backend_choices = plan.backend_choices
        logger.info("dtype %s: %s", str(self.dtype).removeprefix("torch."), self.dtype_reason)
        ctx = self._context(AgreedSelection(registry, plan.backend_choices))
        self.backends = {
            "attention": ctx.attention.name,
            "gemm": ctx.gemm.name,
            "elementwise": ctx.elementwise.name,
            "quantization": ctx.quant.name,
        }
        if ctx.moe is not None:
            self.backends["moe"] = ctx.moe.name
        if ctx.lora is not None:
            self.backends["lora"] = ctx.lora.backend.name
        self.attention, self.moe, self.elementwise = ctx.attention, ctx.moe, ctx.elementwise
        # Served for embeddings (None: for generation): the model then returns hidden states, not logits.
        self.embedding = embedding_config(args, model_path, hf_config)
        embed = self.embedding is not None
        self.model, self.hf_config = load_model(model_path, ctx, registry, config=hf_config, embedding=embed)
        self.lora = self._init_lora(ctx)
        self.long_rope = LongRope.of(hf_config)  # its two rotary sets, if it has them (layers/rotary.py)
        # The model's own limit (position embeddings, or a sliding window it cannot apply).
        model_context = cast(int, self.model.max_context_len)
        self.context_length = args.context_length or model_context
        if self.context_length > model_context:
            raise ValueError(f"context_length: {self.context_length} exceeds what the model supports ({model_context})")
        self._init_memory()
        self.graph_runner, self.graphs = self._init_graphs()

    def _context(self, selector: BackendSelector) -> ModelContext:
        args = self.args
        return ModelContext.create(
            selector,
            self.query,
            self.device,
            attention=args.attention_backend,
            gemm=args.gemm_backend,
            moe=args.moe_backend,
            elementwise=args.elementwise_backend,
            lora=args.lora_backend,
            quantization=self.query.quantization,  # --quantization, or the checkpoint's own
            tp_rank=self.group.rank,
            tp_size=self.group.size,
            comm=self.group.comm,
        )

    def _init_lora(self, ctx: ModelContext) -> LoRAAdapters | None:
        """With ``--enable-lora``: the adaptable layers' slots, and ``--lora-paths`` loaded."""
        if ctx.lora is None:
            return None
        args, max_rank = self.args, cast(int, self.query.max_lora_rank)  # set with --enable-lora
        mapping = getattr(self.model, "map_weight_name", None) or _same_name
        adapters = LoRAAdapters.attach(
            self.model,
            ctx.lora,
            mapping,
            args.max_loras_per_batch,
            max_rank,
            args.max_loaded_loras,
            self.dtype,
            self.device,
        )
        for name, path in args.lora_adapters().items():
            adapters.load(name, path)
        return adapters

    def _init_memory(self) -> None:
        args, q = self.args, self.query
        if q.mla is None:
            assert q.num_kv_heads is not None and q.head_dim is not None  # a model's query names both
            per_token = KVPool.bytes_per_token(self.num_layers, q.num_kv_heads, q.head_dim, self.kv_dtype)
        else:  # multi-head latent attention: one latent entry per token and layer
            per_token = LatentKVPool.entry_bytes_per_token(self.num_layers, q.mla, self.kv_dtype)
        max_running = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        total = self.platform.total_memory_bytes(self.gpu_id)
        available = self.platform.available_memory_bytes(self.gpu_id)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        weights += sum(b.numel() * b.element_size() for b in self.model.buffers())
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        else:
            fraction = args.mem_fraction_static or self.platform.default_mem_fraction
            tokens = kv_pool_tokens(total, available, weights, fraction, per_token, max_running * self.context_length)
        tokens = self.group.min(tokens)  # every rank holds the same pool
        num_pages = tokens // args.page_size
        if num_pages < 1:
            raise ValueError(f"max_total_tokens: the KV pool would hold no page of {args.page_size} tokens")
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(
            max_running + 1, self.context_length + args.page_size, self.device, self.transfer
        )
        self.kv_pool: KVPool | LatentKVPool
        if q.mla is None:
            assert q.num_kv_heads is not None and q.head_dim is not None
            self.kv_pool = KVPool(
                num_pages,
                args.page_size,
                self.num_layers,
                q.num_kv_heads,
                q.head_dim,
                self.kv_dtype,
                self.device,
                layout=self.attention.kv_layout,
                allocate=self.platform.pool_buffer,
            )
        else:
            self.kv_pool = LatentKVPool(
                num_pages,
                args.page_size,
                self.num_layers,
                q.mla,
                self.kv_dtype,
                self.device,
                allocate=self.platform.pool_buffer,
            )
        self.allocator = PagedAllocator(num_pages, args.page_size, self.device, self.transfer)
        self.max_total_tokens = self.allocator.size
        # The figures the pool was sized from (measured after the weights loaded, before the pool).
        self.memory = {
            "total_bytes": total,
            "available_bytes": available,
            "weights_bytes": weights,
            "kv_pool_bytes": self.max_total_tokens * per_token,
        }
        logger.info(
            "KV pool: %d tokens (%d pages of %d), %.1f MiB; memory %.1f GiB total, %.1f GiB available, "
            "weights %.1f GiB",
            self.max_total_tokens,
            num_pages,
            args.page_size,
            self.max_total_tokens * per_token / 2**20,
            total / 2**30,
            available / 2**30,
            weights / 2**30,
        )

    # -- graphs (runtime/execution/graph_runner.py) ---------------------------------------

    def _init_graphs(self) -> tuple[GraphRunner | None, dict[str, Any]]:
        """Capture the decode graphs, or say why not: ``disable_graph`` None means
        wherever possible, False insists (an error if impossible), True is off."""
        args = self.args
        max_bs = min(args.graph_max_bs or self.max_running_requests, self.max_running_requests)
        backend = None if args.disable_graph else self.platform.graph_backend(self.device)
        if args.disable_graph:
            reasons = ["--disable-graph"]
        elif self.embedding is not None:
            reasons = ["an embedding model runs no decode steps"]
        elif backend is None:
            reasons = [f"platform {self.platform.name!r} has no graph capture"]
        else:
            reasons = self.attention.graph_unsupported_reasons(max_bs, self.req_to_token_pool.max_context_len)
            if self.moe is not None:
                reasons += self.moe.graph_unsupported_reasons()
            if self.lora is not None:
                reasons.append("--enable-lora (a step's adapter slots are not captured)")
        if reasons:
            if args.disable_graph is False:
                raise ValueError(f"disable_graph: graphs were asked for, but {'; '.join(reasons)}")
            logger.info("graphs: off (%s); decode steps run eagerly", "; ".join(reasons))
            return None, {"backend": None, "reason": "; ".join(reasons)}
        assert backend is not None  # no reasons: the platform has graph capture
        table = self.req_to_token_pool.req_to_token
        rope_rows = self.long_rope is not None
        runner = GraphRunner(self.model, self.attention, backend, max_bs, table, self.kv_pool, self.device, rope_rows)
        with torch.inference_mode(), self.platform.forward_context():
            runner.capture()
        logger.info(
            "graphs: %s captured for decode batch sizes %s in %.1f s",
            backend.name,
            ",".join(map(str, runner.batch_sizes)),
            runner.capture_seconds,
        )
        return runner, runner.summary()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits for ``batch.logits_indices`` (for an embedding model, the
        final hidden states there). A decode batch that the graphs cover is
        replayed; its logits are then a view that the next forward overwrites. One that
        must keep its hidden states (``capture_hidden``) runs eagerly."""
        if self.lora is not None:
            self.lora.step.batch = batch.lora
        with self.platform.forward_context():
            if self.graph_runner is not None and not batch.capture_hidden and self.graph_runner.can_run(batch):
                return self.graph_runner.replay(batch)
            self.attention.init_forward_metadata(batch)
            logits: torch.Tensor = self.model(batch)
            return logits

    def summary(self) -> dict[str, Any]:
        return {
            "device": self.platform.describe(self.gpu_id),
            "platform": self.platform.name,
            "dtype": str(self.dtype).replace("torch.", ""),
            "dtype_reason": self.dtype_reason,
            "kv_cache_dtype": str(self.kv_dtype).replace("torch.", ""),
            "backends": dict(self.backends),
            # How each kind's backend was chosen, with the figures where they were timed.
            "backend_choices": {kind: choice.describe() for kind, choice in self.backend_choices.items()},
            "tp_size": self.group.size,
            "max_total_tokens": self.max_total_tokens,
            "memory": dict(self.memory),
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "graphs": dict(self.graphs),
            "page_size": self.args.page_size,
            "vocab_size": self.vocab_size,
            "architecture": (self.hf_config.architectures or ["?"])[0],
            "embedding": dataclasses.asdict(self.embedding) if self.embedding is not None else None,
            "lora": self.lora.describe() if self.lora is not None else None,
        }
