"""The model plan: every start-up decision about a model that all its ranks
must share, made once and handed to each rank, which only checks that its
device agrees (``ModelPlan.check_device``).

``plan_model`` decides, in the process that spawns the ranks and before any
starts: the model's config (its tensor-parallel shapes checked), the compute
dtype and why, the kernel query (dtype, KV cache dtype and layout, page size,
heads, experts, quantization) and the shapes backends are timed on. One thing
it leaves to rank 0: the backend of each kind under ``auto``, chosen by timing
the candidates (``choose_backends``). A timing is only true where the kernels
will run: a rank's process has its own thread count and CPU placement (two
ranks on one host split its cores) and its own device, the spawning process
has neither, so rank 0 times them there (or takes them from the timing cache)
and hands the completed plan to the other ranks. Ranks build their backends
from the plan's choices (``AgreedSelection``), so every rank of every node runs
the same kernels. What depends on the rank's own device stays with the rank:
the KV pool's size (measured after its weights load) and the graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from transformers import PretrainedConfig

from radixserve.backend_timing import KindChoice, MeasuredSelection, ModelShapes
from radixserve.checkpoints.loader import (
    check_tp_shapes,
    choose_dtype,
    load_config,
    model_query_for_args,
    model_timing_shapes,
)
from radixserve.config import ServerArgs
from radixserve.kernels import KernelQuery
from radixserve.platform import DtypeChoice, Platform
from radixserve.registry import PluginRegistry

DEFAULT_MAX_RUNNING_REQUESTS = 128
# The shapes backends are timed on: a decode step of up to this many requests and a
# prefill chunk of up to this many tokens (larger ones rank the kernels alike and cost
# more start-up time).
TIMED_DECODE_ROWS = 32
TIMED_PREFILL_ROWS = 1024


@dataclass(frozen=True)
class ModelPlan:
    hf_config: PretrainedConfig
    platform: str  # the platform name the plan was made on
    dtype_choice: DtypeChoice
    query: KernelQuery
    timing_shapes: ModelShapes
    # How each kind's backend was chosen (``KindChoice.chosen`` names it), with the figures where
    # timed; empty until rank 0 chooses them (``choose_backends``).
    backend_choices: dict[str, KindChoice] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.query.kv_dtype or self.query.dtype

    def check_device(self, platform: Platform) -> None:
        """Raise if a rank's platform cannot run this plan: another platform than
        the one it was made on, or one that lacks its dtype."""
        if platform.name != self.platform:
            raise ValueError(
                f"device: this rank runs on platform {platform.name!r}, the model plan was made on {self.platform!r}"
            )
        if self.dtype not in platform.supported_dtypes:
            raise ValueError(f"dtype: {self.dtype} (the model plan's) is not supported by platform {platform.name!r}")


def plan_model(
    args: ServerArgs, model_path: str, platform: type[Platform], config: PretrainedConfig | None = None
) -> ModelPlan:
    """The plan for serving ``model_path`` with ``args`` on ``platform`` (the class:
    nothing here touches a device), its backends not chosen yet. ``config``: the
    model's, where the caller has read it already."""
    hf_config = config if config is not None else load_config(model_path)
    check_tp_shapes(hf_config, args.tp_size)
    dtype_choice = choose_dtype(args.dtype, hf_config, platform)
    query = model_query_for_args(args, hf_config, platform, dtype=dtype_choice.dtype)
    shapes = timing_shapes(args, hf_config, query)
    return ModelPlan(hf_config, platform.name, dtype_choice, query, shapes)


def choose_backends(
    plan: ModelPlan, args: ServerArgs, registry: PluginRegistry, platform: Platform, device_index: int
) -> ModelPlan:
    """``plan`` with each kind's backend chosen (rank 0's part): a named one, or under
    ``auto`` the usable candidates timed on ``platform``'s device ``device_index`` on
    the plan's shapes (or their timings taken from the cache)."""
    selection = MeasuredSelection(
        registry, platform, device_index, plan.timing_shapes, measure_backends=args.backend_selection == "measure"
    )
    # The kinds in the order ModelContext.create selects them; MoE only for a model with experts,
    # LoRA only when it is served.
    requested = {
        "gemm": args.gemm_backend,
        "quantization": plan.query.quantization or "none",  # --quantization, or the checkpoint's own
        "moe": args.moe_backend,
        "lora": args.lora_backend,
        "attention": args.attention_backend,
        "elementwise": args.elementwise_backend,
    }
    for kind, name in requested.items():
        if (kind != "moe" or plan.query.num_experts) and (kind != "lora" or plan.query.max_lora_rank):
            selection.select(kind, plan.query, name)
    return replace(plan, backend_choices=dict(selection.choices))


def timing_shapes(args: ServerArgs, hf_config: PretrainedConfig, query: KernelQuery) -> ModelShapes:
    """The shapes backends are timed on: one rank's share of the model at a decode
    step and a prefill chunk no larger than the server runs."""
    chunk = args.chunked_prefill_size if args.chunked_prefill_size not in (None, -1) else 2048
    shapes = model_timing_shapes(
        hf_config,
        query,
        tp_size=args.tp_size,
        decode_rows=min(args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS, TIMED_DECODE_ROWS),
        prefill_rows=min(chunk, TIMED_PREFILL_ROWS),
        context_length=args.context_length or int(getattr(hf_config, "max_position_embeddings", 2048)),
    )
    return replace(shapes, lora_slots=args.max_loras_per_batch)
