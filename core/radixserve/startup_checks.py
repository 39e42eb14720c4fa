"""The server's start-up checks, before any process starts: ``check_startup``
runs every check that needs no child process (model directory, device, backend
names and, for a local model, their usability), and ``build_backends`` builds
the usable backends so that nothing compiles after the server says it is
listening. Each failure is one line (plus a hint) for the operator.

The runtime processes themselves start in ``runtime/processes/spawn.py``.
"""

from __future__ import annotations

from radixserve.config import ServerArgs
from radixserve.kernels import KernelQuery
from radixserve.startup_error import StartupError

PLUGINS_HINT = "`radixserve plugins` lists every platform and backend and why each is usable here or not"
TP_HINT = "--tp-size ranks each hold an equal share of every layer: pick one of the sizes the error lists"
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
    dtype alone where the model's shapes are not known yet), for ``build_backends``."""
    from radixserve.checkpoints.embedding import embedding_config
    from radixserve.checkpoints.loader import (
        check_tp_shapes,
        load_config,
        model_class,
        model_query_for_args,
        safetensors_files,
    )
    from radixserve.checkpoints.source import check_model_source, check_tokenizer_source, is_hub_id
    from radixserve.registry import PluginError, get_registry

    if args.model_path is not None:
        try:
            check_model_source(args.model_path)
            check_tokenizer_source(args.tokenizer_path or args.model_path)
        except ValueError as exc:
            raise StartupError(str(exc), MODEL_HINT) from exc
    registry = get_registry()
    try:
        platform = registry.resolve_platform(args.device)
        registry.grammar_backend(args.grammar_backend)  # one that cannot load is an error, never a fallback
        if args.tool_call_parser is not None:
            registry.tool_parser(args.tool_call_parser)
        if args.reasoning_parser is not None:
            registry.reasoning_parser(args.reasoning_parser)
    except PluginError as exc:
        raise StartupError(str(exc), PLUGINS_HINT) from exc
    forced = {kind: name for kind, name in _forced_backends(args).items() if name != "auto"}
    for kind, name in forced.items():
        if name not in registry.candidates[kind]:
            flag = "--quantization" if kind == "quantization" else f"--{kind}-backend"
            what = "quantization method" if kind == "quantization" else f"{kind} backend"
            raise StartupError(
                f"{flag} {name!r} is not a registered {what}; registered: "
                f"{', '.join(sorted(registry.candidates[kind])) or 'none'}",
                PLUGINS_HINT,
            )
    if args.model_path is None or is_hub_id(args.model_path):
        # The model's shapes are known once it is built or downloaded; the scheduler checks them then.
        return KernelQuery(device=platform.name, dtype=platform.default_dtype)
    try:
        config = load_config(args.model_path)
        architectures = getattr(config, "architectures", None) or []
        if not architectures:
            raise ValueError(f"model_path: {args.model_path}/config.json names no architectures")
        model_class(registry, architectures[0])
        embedding_config(args, args.model_path, config)  # the flags agree with the model and its pooling is served
        try:
            check_tp_shapes(config, args.tp_size)
        except ValueError as exc:
            raise StartupError(str(exc), TP_HINT) from exc
        safetensors_files(args.model_path)
        query = model_query_for_args(args, config, platform)
        for kind, name in forced.items():
            if kind != "moe" or query.num_experts:
                registry.forced(kind, query, name)
    except PluginError as exc:
        raise StartupError(str(exc), PLUGINS_HINT) from exc
    except (ValueError, OSError, KeyError) as exc:
        raise StartupError(f"{type(exc).__name__}: {exc}", MODEL_HINT) from exc
    return query


def build_backends(query: KernelQuery) -> None:
    """Build every backend usable for ``query`` (compiled kernels: seconds on a
    machine's first start), so that nothing compiles after the server says it is
    listening. A backend whose build fails is logged and ``auto`` passes over it;
    the scheduler fails a forced one with the same reason."""
    from radixserve.registry import get_registry

    get_registry().build_usable(query)


def _forced_backends(args: ServerArgs) -> dict[str, str]:
    return {
        "attention": args.attention_backend,
        "gemm": args.gemm_backend,
        "moe": args.moe_backend,
        "elementwise": args.elementwise_backend,
        "quantization": args.quantization or "none",
    }
