"""Builds the model on the selected platform and backends, owns the KV memory,
and runs one forward per step."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

from radixserve.cache.memory_pool import KVPool, PagedAllocator, ReqToTokenPool
from radixserve.config import ServerArgs
from radixserve.forward_batch import ForwardBatch
from radixserve.kernels import KernelQuery
from radixserve.layers.context import ModelContext
from radixserve.model_loader import load_model, resolve_dtype
from radixserve.registry import PluginRegistry

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 128
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    """What the runtime needs to know of the architecture."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    num_experts: int | None
    top_k: int | None

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> "ModelShape":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            context_length=config.max_position_embeddings,
            num_experts=experts,
            top_k=getattr(config, "num_experts_per_tok", None) if experts else None,
        )


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str, registry: PluginRegistry, tp_rank: int = 0):
        self.args = args
        self.platform = registry.resolve_platform(args.device)()
        self.device = self.platform.device(tp_rank)
        hf_config = AutoConfig.from_pretrained(model_path)
        self.shape = ModelShape.from_config(hf_config)
        self.dtype = resolve_dtype(args.dtype, hf_config, self.platform)
        self.kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else _DTYPES[args.kv_cache_dtype]
        self.context_length = args.context_length or self.shape.context_length
        if self.context_length > self.shape.context_length:
            logger.warning("context_length %d exceeds the model's %d", self.context_length, self.shape.context_length)

        s = self.shape
        self.query = KernelQuery(
            device=self.platform.name,
            dtype=self.dtype,
            head_dim=s.head_dim,
            num_heads=s.num_heads // args.tp_size,
            num_kv_heads=max(s.num_kv_heads // args.tp_size, 1),
            page_size=args.page_size,
            kv_dtype=self.kv_dtype,
            num_experts=s.num_experts,
            top_k=s.top_k,
            quantization=args.quantization,
        )
        self.backends = {
            kind: registry.select(kind, self.query, requested)
            for kind, requested in (
                ("attention", args.attention_backend),
                ("gemm", args.gemm_backend),
                ("quantization", args.quantization or "none"),
            )
        }
        if s.num_experts:
            self.backends["moe"] = registry.select("moe", self.query, args.moe_backend)
        gemm = self.backends["gemm"](self.query)
        ctx = ModelContext(
            attention=self.backends["attention"](self.query),
            gemm=gemm,
            quant=self.backends["quantization"](self.query, gemm),
            moe=self.backends["moe"](self.query) if "moe" in self.backends else None,
            dtype=self.dtype,
            device=self.device,
            tp_rank=tp_rank,
            tp_size=args.tp_size,
        )
        self.attention = ctx.attention
        self.model, self.hf_config = load_model(model_path, ctx, registry)
        self._init_memory()

    def _init_memory(self) -> None:
        s, args = self.shape, self.args
        per_token = KVPool.bytes_per_token(s.num_layers, self.query.num_kv_heads, s.head_dim, self.kv_dtype)
        max_running = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        else:
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            weights += sum(b.numel() * b.element_size() for b in self.model.buffers())
            budget = min(
                self.platform.total_memory_bytes() * args.mem_fraction_static - weights,
                self.platform.available_memory_bytes() * args.mem_fraction_static,
            )
            # No point in more slots than every running request at full context.
            tokens = int(min(budget // per_token, max_running * self.context_length))
        num_pages = tokens // args.page_size
        if num_pages < 1:
            raise ValueError(f"max_total_tokens: the KV pool would hold no page of {args.page_size} tokens")
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running + 1, self.context_length + args.page_size, self.device)
        self.kv_pool = KVPool(num_pages, args.page_size, s.num_layers, self.query.num_kv_heads, s.head_dim,
                              self.kv_dtype, self.device)
        self.allocator = PagedAllocator(num_pages, args.page_size, self.device)
        self.max_total_tokens = self.allocator.size
        logger.info("KV pool: %d tokens (%d pages of %d), %.1f MiB", self.max_total_tokens, num_pages,
                    args.page_size, self.max_total_tokens * per_token / 2**20)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits for ``batch.logits_indices``."""
        with self.platform.forward_context():
            self.attention.init_forward_metadata(batch)
            return self.model(batch)

    def summary(self) -> dict:
        return {
            "device": self.platform.describe(),
            "platform": self.platform.name,
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_cache_dtype": str(self.kv_dtype).replace("torch.", ""),
            "backends": {kind: cls.name for kind, cls in self.backends.items()},
            "max_total_tokens": self.max_total_tokens,
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "page_size": self.args.page_size,
            "vocab_size": self.shape.vocab_size,
            "architecture": (self.hf_config.architectures or ["?"])[0],
        }
