"""The server's start-up, before the HTTP server. ``check_startup`` runs every
check that needs no child process, in three parts: ``check_sources`` (the
model's directory, tokenizer and weight files: the file system only, so a
wrong path is reported before torch loads or any child starts), ``check_args``
(device, backend names) and ``check_model`` (a local model's architecture and
what the backends make of it, which reads its config);
``build_backends`` builds the usable backends so that nothing compiles after
the server says it is listening; ``start_runtime`` spawns the runtime processes
when the model is at hand, a lone scheduler even before the checks. Each
failure is one line (plus a hint) for the operator.

The runtime processes themselves start in ``runtime/processes/spawn.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.config import ServerArgs
from radixserve.startup_error import StartupError

if TYPE_CHECKING:  # torch: the CLI spawns a lone scheduler (start_runtime) before it imports it
    from radixserve.kernels import KernelQuery
    from radixserve.platform import Platform
    from radixserve.runtime.execution.model_plan import ModelPlan
    from radixserve.runtime.processes.spawn import SpawnedRuntime

PLUGINS_HINT = "`radixserve plugins` lists every platform and backend and why each is usable here or not"
TP_HINT = "--tp-size ranks each hold an equal share of every layer: pick one of the sizes the error lists"
LORA_HINT = (
    "--lora-paths takes NAME=PATH entries, each PATH a PEFT LoRA adapter directory (adapter_config.json and "
    "adapter_model.safetensors) of rank at most --max-lora-rank; docs/lora.md"
)
MODEL_HINT = (
    "--model takes a local HuggingFace model directory (with config.json) or a hub repo id "
    "(org/name); without --model the built-in demo model is served"
)


def check_startup(args: ServerArgs) -> KernelQuery:
    """Raise StartupError for what is wrong with ``args`` that can be seen
    without starting a child process or initialising any accelerator: the model
    and tokenizer directories, ``--device``, the backend and parser names (``--grammar-backend``,
    ``--tool-call-parser`` and ``--reasoning-parser`` too), and (for a local model) the
    model's architecture, dtype, weight files, embedding settings and each forced backend's support
    for it. Returns the query the backends were checked for (the device and
    dtype alone where the model's shapes are not known yet), for ``build_backends``:
    ``check_sources``, ``check_args``, then ``check_model``."""
    check_sources(args)
    return check_model(args, check_args(args))[0]


def check_sources(args: ServerArgs) -> None:
    """The model and tokenizer directories (``--model``, ``--tokenizer-path``):
    they exist and hold a config.json, tokenizer files and a safetensors
    checkpoint, or name a hub repo (checked once downloaded). The file system
    only: no torch, no plugin."""
    from radixserve.checkpoints.gguf import is_materialized
    from radixserve.checkpoints.source import (
        check_model_source,
        check_tokenizer_source,
        is_hub_id,
        safetensors_files,
    )

    for flag in ("speculative_draft_model_path", "speculative_eagle_path"):
        path = getattr(args, flag)
        if path is None:
            continue
        try:
            check_model_source(path)
            safetensors_files(path)
        except (ValueError, OSError, KeyError) as exc:
            raise StartupError(f"{flag}: {exc}", MODEL_HINT) from exc
    if args.model_path is None:
        return
    try:
        check_model_source(args.model_path)
        check_tokenizer_source(args.tokenizer_path or args.model_path)
    except ValueError as exc:
        raise StartupError(str(exc), MODEL_HINT) from exc
    if is_hub_id(args.model_path) or is_materialized(args.model_path):  # a GGUF file's weights are in the file
        return
    try:
        safetensors_files(args.model_path)
    except (ValueError, OSError, KeyError) as exc:  # no weights, or an index that is no JSON or has no weight_map
        raise StartupError(f"{type(exc).__name__}: {exc}", MODEL_HINT) from exc


def check_args(args: ServerArgs) -> type[Platform]:
    """The checks that read no model file and need the plugins: ``--device``,
    and the backend and parser names (``--grammar-backend``,
    ``--tool-call-parser``, ``--reasoning-parser``, ``--speculative-algorithm``).
    Returns the platform."""
    from radixserve.registry import PluginError, get_registry
    from radixserve.speculative.base import model_path_error

    registry = get_registry()
    try:
        platform = registry.resolve_platform(args.device)
        registry.grammar_backend(args.grammar_backend)  # one that cannot load is an error, never a fallback
        if args.tool_call_parser is not None:
            registry.tool_parser(args.tool_call_parser)
        if args.reasoning_parser is not None:
            registry.reasoning_parser(args.reasoning_parser)
        if args.speculative_algorithm is not None:
            proposer = registry.proposer(args.speculative_algorithm)
            error = model_path_error(
                args.speculative_algorithm, proposer, args.speculative_draft_model_path, args.speculative_eagle_path
            )
            if error is not None:
                raise StartupError(error)
    except PluginError as exc:
        raise StartupError(str(exc), PLUGINS_HINT) from exc
    for kind, name in _forced_backends(args, args.quantization).items():
        if name not in registry.candidates[kind]:
            flag = "--quantization" if kind == "quantization" else f"--{kind}-backend"
            what = "quantization method" if kind == "quantization" else f"{kind} backend"
            raise StartupError(
                f"{flag} {name!r} is not a registered {what}; registered: "
                f"{', '.join(sorted(registry.candidates[kind])) or 'none'}",
                PLUGINS_HINT,
            )
    return platform


def check_model(args: ServerArgs, platform: type[Platform]) -> tuple[KernelQuery, ModelPlan | None]:
    """The checks that read a local model's config (transformers' configuration
    classes: over a second of CPU): its architecture, dtype, embedding settings,
    tensor-parallel split and each forced backend's support for it. Returns the
    query for ``build_backends`` and, for a local model, the model plan its ranks
    are handed (made from the config read here, so the server reads it once);
    for the demo model and a hub id, whose shapes are known once built or
    downloaded, the device and dtype alone and no plan (it is made when the
    runtime is spawned)."""
    from radixserve.checkpoints.embedding import embedding_config
    from radixserve.checkpoints.loader import check_tp_shapes, load_config, model_class
    from radixserve.checkpoints.lora import AdapterError
    from radixserve.checkpoints.source import is_hub_id
    from radixserve.kernels import KernelQuery
    from radixserve.models.base import check_served_alone
    from radixserve.registry import PluginError, get_registry
    from radixserve.runtime.execution.model_plan import plan_model

    if args.model_path is None or is_hub_id(args.model_path):
        return KernelQuery(device=platform.name, dtype=platform.default_dtype), None
    registry = get_registry()
    try:
        config = load_config(args.model_path)
        architectures = getattr(config, "architectures", None) or []
        if not architectures:
            raise ValueError(f"model_path: {args.model_path}/config.json names no architectures")
        check_served_alone(model_class(registry, architectures[0]), args.model_path)
        embedding_config(args, args.model_path, config)  # the flags agree with the model and its pooling is served
        try:
            check_tp_shapes(config, args.tp_size)
        except ValueError as exc:
            raise StartupError(str(exc), TP_HINT) from exc
        plan = plan_model(args, args.model_path, platform, config)
        query = plan.query
        for kind, name in _forced_backends(args, query.quantization).items():
            if (kind != "moe" or query.num_experts) and (kind != "lora" or query.max_lora_rank):
                registry.forced(kind, query, name)
    except PluginError as exc:
        raise StartupError(str(exc), PLUGINS_HINT) from exc
    except AdapterError as exc:
        raise StartupError(str(exc), LORA_HINT) from exc
    except (ValueError, OSError, KeyError) as exc:
        raise StartupError(f"{type(exc).__name__}: {exc}", MODEL_HINT) from exc
    return query, plan


def build_backends(query: KernelQuery) -> None:
    """Build every backend usable for ``query`` (compiled kernels: seconds on a
    machine's first start), so that nothing compiles after the server says it is
    listening. A backend whose build fails is logged and ``auto`` passes over it;
    the scheduler fails a forced one with the same reason."""
    from radixserve.registry import get_registry

    get_registry().build_usable(query)


def start_runtime(
    args: ServerArgs, platform: type[Platform] | None = None, plan: ModelPlan | None = None
) -> SpawnedRuntime | None:
    """Spawn the runtime now if the model is at hand (a local model directory, or
    the demo model built by an earlier start), so that the scheduler imports torch
    and loads the model while this process checks, builds the backends and
    imports and starts the HTTP server, instead of after. None where the model
    takes a download: the server's boot resolves it and spawns the runtime then,
    after it says it is listening, so that /health answers meanwhile. The demo
    model's first build is the boot's too, but its directory is known: the
    runtime is spawned held on it now, and the boot releases it once the model
    is built (``needs_model_build``).

    Without ``platform``, before any check: only a lone scheduler (tp and dp
    1: it needs nothing from the platform), and held: its scheduler imports
    torch and the model code, then waits for ``RuntimeProcesses.release`` (the
    checks passed, the backends are built) before it reads the model, or is
    stopped. With ``platform`` (``check_args``'s), after the checks: any runtime,
    handed ``plan`` (``check_model``'s) when there is one.

    Call it from the thread that will run the server (the children die with it)."""
    from radixserve.checkpoints.source import model_path_at_hand
    from radixserve.runtime.processes.spawn import spawn_runtime

    if platform is None and args.tp_size * args.dp_size > 1:
        return None  # several ranks: their environment comes from the platform, their rendezvous from the checks
    model_path = model_path_at_hand(args)
    if model_path is None and platform is None and needs_model_build(args):
        from radixserve.checkpoints.demo import demo_model_dir

        model_path = str(demo_model_dir())
    if model_path is None:
        return None
    return spawn_runtime(args, model_path, platform, held=platform is None, plan=plan)


def needs_model_build(args: ServerArgs) -> bool:
    """Whether the model is the demo model and not built yet (the server's boot builds it)."""
    from radixserve.checkpoints.demo import demo_model_built

    return args.model_path is None and not demo_model_built()


def _forced_backends(args: ServerArgs, quantization: str | None) -> dict[str, str]:
    """The backends the flags force: all but ``auto``, and the quantization method
    (``--quantization``, or once the model is read a quantized checkpoint's own; neither: ``none``)."""
    named = {
        "attention": args.attention_backend,
        "gemm": args.gemm_backend,
        "moe": args.moe_backend,
        "lora": args.lora_backend,
        "elementwise": args.elementwise_backend,
        "quantization": quantization or "none",
    }
    return {kind: name for kind, name in named.items() if name != "auto"}
