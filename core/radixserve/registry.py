"""Plugin manager: entry-point loading, allow-list, kept errors, and selection.

One registry per process (``get_registry()``). The scheduler and worker
processes are spawned, so each builds its own from the entry points: loading and
registration are idempotent and side-effect free.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from radixserve import hooks
from radixserve.kernels.kv_transfer import KVSide, KVTransferBackend
from radixserve.kernels.query import KernelQuery
from radixserve.reasoning_parsers.base import ReasoningParser
from radixserve.speculative.base import Proposer

if TYPE_CHECKING:
    from radixserve.platform import Platform

logger = logging.getLogger(__name__)

# kind -> hook that registers it
KIND_HOOKS: dict[str, str] = {
    "platform": "register_platforms",
    "attention": "register_attention_backends",
    "gemm": "register_gemm_backends",
    "moe": "register_moe_backends",
    "lora": "register_lora_backends",
    "elementwise": "register_elementwise_backends",
    "quantization": "register_quantization_methods",
    "model": "register_models",
    "kv_transfer": "register_kv_transfer_backends",
    "grammar": "register_grammar_backends",
    "speculative": "register_speculative_proposers",
    "tool": "register_tool_parsers",
    "reasoning": "register_reasoning_parsers",
}
SELECTABLE_KINDS = ("attention", "gemm", "moe", "lora", "elementwise", "quantization")
ALLOW_LIST_ENV = "RADIXSERVE_PLUGINS"
TRACE_ENV = "RADIXSERVE_TRACE_PLUGINS"
BUILTIN_MODELS_PLUGIN = "radixserve-models"
BUILTIN_GRAMMAR_PLUGIN = "radixserve-grammar"
BUILTIN_KV_TRANSFER_PLUGIN = "radixserve-kv-transfer"
BUILTIN_SPECULATIVE_PLUGIN = "radixserve-speculative"
BUILTIN_TOOL_PLUGIN = "radixserve-tool-parsers"
BUILTIN_REASONING_PLUGIN = "radixserve-reasoning-parsers"
DEFAULT_TOOL_PARSER = "hermes"


class PluginError(RuntimeError):
    """Selection or resolution failed; the message says why and what exists."""


@dataclass
class PluginInfo:
    name: str
    distribution: str | None = None
    version: str | None = None
    module: str | None = None
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Candidate:
    kind: str
    name: str
    # A platform, backend, model, grammar backend or tool parser class, per ``kind``:
    # each kind has its own contract, reached by its class attributes.
    cls: type[Any]
    plugin: str

    @property
    def priority(self) -> int:
        return getattr(self.cls, "priority", 0)


def _allow_list() -> set[str] | None:
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None or raw.strip() == "":
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


class PluginRegistry:
    def __init__(self, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager(hooks.PROJECT_NAME)
        self.pm.add_hookspecs(hooks)
        if os.environ.get(TRACE_ENV):
            self.pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[radixserve plugins] {msg}"))
            self.pm.enable_tracing()
        self.plugins: dict[str, PluginInfo] = {}
        self._candidates: dict[str, dict[str, Candidate]] | None = None
        # The core's own architectures and grammar backends register through the same hooks as anyone's.
        import radixserve.disaggregation.builtin
        import radixserve.models
        import radixserve.reasoning_parsers.builtin
        import radixserve.speculative.builtin
        import radixserve.structured_output.builtin
        import radixserve.tool_parsers.builtin

        self.register_plugin(radixserve.models, BUILTIN_MODELS_PLUGIN)
        self.register_plugin(radixserve.structured_output.builtin, BUILTIN_GRAMMAR_PLUGIN)
        self.register_plugin(radixserve.disaggregation.builtin, BUILTIN_KV_TRANSFER_PLUGIN)
        self.register_plugin(radixserve.speculative.builtin, BUILTIN_SPECULATIVE_PLUGIN)
        self.register_plugin(radixserve.tool_parsers.builtin, BUILTIN_TOOL_PLUGIN)
        self.register_plugin(radixserve.reasoning_parsers.builtin, BUILTIN_REASONING_PLUGIN)
        if load_entry_points:
            self.load_entry_points()

    # ---- loading -------------------------------------------------------
    def load_entry_points(self) -> None:
        allowed = _allow_list()
        for ep in importlib.metadata.entry_points(group=hooks.ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            if allowed is not None and ep.name not in allowed and dist not in allowed:
                logger.info("plugin %s skipped: not in %s", ep.name, ALLOW_LIST_ENV)
                continue
            if ep.name in self.plugins:
                continue
            info = PluginInfo(
                name=ep.name,
                distribution=dist,
                version=ep.dist.version if ep.dist is not None else None,
                module=ep.value,
            )
            self.plugins[ep.name] = info
            try:
                obj = ep.load()
            except Exception:
                info.error = traceback.format_exc(limit=4).strip()
                _log_plugin_error(f"plugin {ep.name} failed to load", info.error)
                continue
            self._register(obj, info)

    def register_plugin(self, obj: Any, name: str) -> PluginInfo:
        """Add an in-process plugin object (a module, class or instance with hookimpls)."""
        info = PluginInfo(name=name, module=getattr(obj, "__name__", type(obj).__name__))
        self.plugins[name] = info
        self._register(obj, info)
        return info

    def unregister_plugin(self, name: str) -> None:
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)
        self.plugins.pop(name, None)
        self._candidates = None

    def _register(self, obj: Any, info: PluginInfo) -> None:
        try:
            self.pm.register(obj, name=info.name)
            self.pm.check_pending()
        except Exception as exc:  # a misspelt or malformed hookimpl
            if self.pm.has_plugin(info.name):
                self.pm.unregister(name=info.name)
            info.error = f"{type(exc).__name__}: {exc}"
            logger.error("plugin %s rejected: %s", info.name, info.error)
            return
        info.hooks = sorted(impl.name for impl in self._hookimpls_of(info.name))
        self._candidates = None

    def _hookimpls_of(self, plugin_name: str) -> list[Any]:
        plugin = self.pm.get_plugin(plugin_name)
        return [c for c in (self.pm.get_hookcallers(plugin) or [])]

    # ---- collection ----------------------------------------------------
    @property
    def candidates(self) -> dict[str, dict[str, Candidate]]:
        if self._candidates is None:
            self._candidates = self._collect()
        return self._candidates

    def _collect(self) -> dict[str, dict[str, Candidate]]:
        found: dict[str, dict[str, Candidate]] = {kind: {} for kind in KIND_HOOKS}
        for info in self.plugins.values():
            info.registered = {}
        for kind, hook_name in KIND_HOOKS.items():
            caller = getattr(self.pm.hook, hook_name)
            # Call each plugin's implementation separately so every class is
            # attributed to the plugin that registered it.
            for impl in reversed(caller.get_hookimpls()):
                plugin = self.plugins.get(impl.plugin_name)
                if plugin is None or plugin.error:
                    continue
                try:
                    impl.function(register=self._register_callback(kind, plugin, found[kind]))
                except Exception:
                    plugin.error = traceback.format_exc(limit=4).strip()
                    _log_plugin_error(f"plugin {plugin.name} failed in {hook_name}", plugin.error)
        return found

    def _register_callback(
        self, kind: str, info: PluginInfo, table: dict[str, Candidate]
    ) -> Callable[[type[Any]], None]:
        def register(cls: type[Any]) -> None:
            given: list[object] = (
                list(getattr(cls, "architectures", ())) if kind == "model" else [getattr(cls, "name", None)]
            )
            names = [n for n in given if isinstance(n, str) and n]
            if not names or len(names) != len(given):
                raise TypeError(f"{kind} class {cls!r} has no name")
            for name in names:
                previous = table.get(name)
                if previous is not None and previous.cls is not cls:
                    raise PluginError(f"{kind} {name!r} is already registered by plugin {previous.plugin!r}")
                table[name] = Candidate(kind, name, cls, info.name)
                info.registered.setdefault(kind, []).append(name)

        return register

    # ---- queries -------------------------------------------------------
    def load_errors(self) -> dict[str, str]:
        _ = self.candidates  # registration errors land on the plugin too
        return {name: info.error for name, info in self.plugins.items() if info.error}

    def _load_error_note(self) -> str:
        errors = self.load_errors()
        if not errors:
            return ""
        lines = [f"  plugin {name!r} failed: {err.splitlines()[-1]}" for name, err in errors.items()]
        return "\nPlugins that failed to load (run `radixserve plugins` for details):\n" + "\n".join(lines)

    def resolve_platform(self, device: str = "auto") -> type[Platform]:
        """The Platform class for ``--device``; never falls back silently."""
        platforms = self.candidates["platform"]
        if device == "auto":
            errors = self.load_errors()
            if errors:
                raise PluginError(
                    "--device auto refuses to guess while plugins failed to load; fix them, exclude them with "
                    f"{ALLOW_LIST_ENV}, or name --device explicitly." + self._load_error_note()
                )
            usable = []
            for cand in sorted(platforms.values(), key=lambda c: -c.priority):
                reasons = cand.cls.unavailable_reasons()
                if reasons:
                    logger.info("device %s not usable: %s", cand.name, "; ".join(reasons))
                else:
                    usable.append(cand)
            if not usable:
                raise PluginError("no usable device platform registered" + self._load_error_note())
            return usable[0].cls
        named = platforms.get(device)
        if named is None:
            raise PluginError(
                f"--device {device!r} is not a registered platform; available: {self._platform_summary()}"
                + self._load_error_note()
            )
        reasons = named.cls.unavailable_reasons()
        if reasons:
            raise PluginError(
                f"--device {device!r} (plugin {named.plugin!r}) is not usable here: "
                + "; ".join(reasons)
                + f"\nAvailable: {self._platform_summary()}"
            )
        return named.cls

    def _platform_summary(self) -> str:
        parts = []
        for cand in self.candidates["platform"].values():
            reasons = cand.cls.unavailable_reasons()
            parts.append(cand.name + ("" if not reasons else f" (unusable: {'; '.join(reasons)})"))
        return ", ".join(parts) or "none"

    def select(self, kind: str, query: KernelQuery, requested: str = "auto") -> type:
        """Pick a backend class of ``kind`` for ``query`` by priority: a forced name
        must support the query and build; ``auto`` takes the highest priority
        usable candidate (``usable``). Selection by measurement
        (radixserve/backend_timing.py) starts from the same candidates."""
        if requested != "auto":
            return self.forced(kind, query, requested)
        return self.usable(kind, query)[0].cls

    def forced(self, kind: str, query: KernelQuery, name: str) -> type:
        """The backend named by ``--<kind>-backend NAME``, or a PluginError saying why it cannot serve."""
        table = self._table(kind)
        cand = table.get(name)
        if cand is None:
            raise PluginError(
                f"unknown {kind} backend {name!r}; registered: {sorted(table) or 'none'}" + self._load_error_note()
            )
        reasons = cand.cls.unsupported_reasons(query) or _build_reasons(cand)
        if reasons:
            raise PluginError(
                f"{kind} backend {name!r} (plugin {cand.plugin!r}) cannot serve {query.describe()}: "
                + "; ".join(reasons)
            )
        return cand.cls

    def usable(self, kind: str, query: KernelQuery) -> list[Candidate]:
        """Every candidate of ``kind`` that supports ``query`` and builds here, highest
        priority first; each rejected one is logged with its reasons, and none
        left is a PluginError listing them."""
        rejected = []
        usable = []
        for cand in sorted(self._table(kind).values(), key=lambda c: (-c.priority, c.name)):
            reasons = cand.cls.unsupported_reasons(query) or _build_reasons(cand)
            if reasons:
                rejected.append(f"{cand.name}: {'; '.join(reasons)}")
                logger.info("rejected %s backend %s: %s", kind, cand.name, "; ".join(reasons))
            else:
                usable.append(cand)
        if not usable:
            raise PluginError(
                f"no {kind} backend supports {query.describe()}; rejected: {rejected or 'none registered'}"
                + self._load_error_note()
            )
        return usable

    def build_usable(self, query: KernelQuery) -> dict[str, list[str]]:
        """Build every backend that supports ``query`` (a device and dtype), before
        the server says it is listening, so that no kernel compiles at the first
        request. Returns, per kind, the backends whose build failed and why (those
        are logged and ``auto`` passes over them)."""
        failed: dict[str, list[str]] = {}
        for kind in SELECTABLE_KINDS:
            for cand in sorted(self._table(kind).values(), key=lambda c: (-c.priority, c.name)):
                if cand.cls.unsupported_reasons(query):
                    continue
                for reason in _build_reasons(cand):
                    logger.warning("%s backend %s is passed over: %s", kind, cand.name, reason)
                    failed.setdefault(kind, []).append(f"{cand.name}: {reason}")
        return failed

    def _table(self, kind: str) -> dict[str, Candidate]:
        if kind not in SELECTABLE_KINDS:
            raise ValueError(f"unknown backend kind {kind!r}")
        return self.candidates[kind]

    def model_class(self, architecture: str) -> type:
        cand = self.candidates["model"].get(architecture)
        if cand is None:
            raise PluginError(
                f"model architecture {architecture!r} is not registered; registered: "
                f"{sorted(self.candidates['model'])}" + self._load_error_note()
            )
        return cand.cls

    def grammar_backend(self, requested: str = "auto") -> type | None:
        """The ``GrammarBackend`` class for ``--grammar-backend``: None for ``none``, the
        highest-priority registered one for ``auto``. One that cannot load here is a
        PluginError saying why; there is no fallback to another."""
        if requested == "none":
            return None
        table = self.candidates["grammar"]
        if requested == "auto":
            if not table:
                raise PluginError("no grammar backend is registered" + self._load_error_note())
            cand = max(table.values(), key=lambda c: (c.priority, c.name))
        elif requested in table:
            cand = table[requested]
        else:
            raise PluginError(
                f"unknown grammar backend {requested!r}; registered: {sorted(table) or 'none'} (or none)"
                + self._load_error_note()
            )
        reasons = cand.cls.unavailable_reasons()
        if reasons:
            raise PluginError(
                f"grammar backend {cand.name!r} (plugin {cand.plugin!r}) cannot load: " + "; ".join(reasons)
            )
        return cand.cls

    def kv_transfer_backend(self, requested: str, side: KVSide) -> type[KVTransferBackend]:
        """The ``KVTransferBackend`` class for ``--disaggregation-transfer-backend``, for a
        worker whose KV is ``side``. One that cannot serve it is a PluginError saying why;
        there is no fallback to another."""
        cand = self._registered("kv_transfer", requested, "--disaggregation-transfer-backend", "KV transfer backend")
        if not (isinstance(cand.cls, type) and issubclass(cand.cls, KVTransferBackend)):
            raise PluginError(f"KV transfer backend {requested!r} (plugin {cand.plugin!r}) is not a KVTransferBackend")
        reasons = cand.cls.unsupported_reasons(side)
        if reasons:
            raise PluginError(
                f"KV transfer backend {requested!r} (plugin {cand.plugin!r}) cannot serve this worker: "
                + "; ".join(reasons)
            )
        return cand.cls

    def proposer(self, requested: str) -> type[Proposer]:
        """The ``Proposer`` class for ``--speculative-algorithm``. One that cannot run
        here is a PluginError saying why; there is no fallback to another."""
        cand = self._registered("speculative", requested, "--speculative-algorithm", "speculative proposer")
        if not (isinstance(cand.cls, type) and issubclass(cand.cls, Proposer)):
            raise PluginError(f"speculative proposer {requested!r} (plugin {cand.plugin!r}) is not a Proposer")
        reasons = cand.cls.unavailable_reasons()
        if reasons:
            raise PluginError(
                f"speculative proposer {requested!r} (plugin {cand.plugin!r}) cannot load: " + "; ".join(reasons)
            )
        return cand.cls

    def tool_parser(self, requested: str | None = None, template: str | None = None) -> type:
        """The ``ToolParser`` class for ``--tool-call-parser``; unset: the highest-priority
        one whose ``matches_template`` recognises the chat template, else ``hermes``."""
        table = self.candidates["tool"]
        if requested is None:
            for cand in sorted(table.values(), key=lambda c: (-c.priority, c.name)):
                if template and cand.cls.matches_template(template):
                    return cand.cls
            requested = DEFAULT_TOOL_PARSER
        if requested not in table:
            raise PluginError(
                f"unknown tool call parser {requested!r}; registered: {sorted(table) or 'none'}"
                + self._load_error_note()
            )
        return table[requested].cls

    def reasoning_parser(self, requested: str) -> type[ReasoningParser]:
        """The ``ReasoningParser`` class for ``--reasoning-parser``."""
        cand = self._registered("reasoning", requested, "--reasoning-parser", "reasoning parser")
        if not issubclass(cand.cls, ReasoningParser):
            raise PluginError(f"reasoning parser {requested!r} (plugin {cand.plugin!r}) is not a ReasoningParser")
        return cand.cls

    def _registered(self, kind: str, requested: str, flag: str, what: str) -> Candidate:
        """The candidate of ``kind`` named ``requested`` (by ``flag``); a PluginError
        listing the registered ones when there is none."""
        table = self.candidates[kind]
        if requested not in table:
            raise PluginError(
                f"{flag} {requested!r} is not a registered {what}; registered: "
                f"{', '.join(sorted(table)) or 'none'}" + self._load_error_note()
            )
        return table[requested]

    def report(self) -> dict[str, Any]:
        """What ``radixserve plugins`` prints: plugins, their backends, and usability here."""
        candidates = self.candidates
        platform_rows, device_for_query = [], None
        for cand in sorted(candidates["platform"].values(), key=lambda c: -c.priority):
            reasons = cand.cls.unavailable_reasons()
            platform_rows.append(
                {
                    "name": cand.name,
                    "plugin": cand.plugin,
                    "priority": cand.priority,
                    "usable": not reasons,
                    "reasons": reasons,
                }
            )
            if not reasons and device_for_query is None:
                device_for_query = cand.cls
        backends: dict[str, list[dict[str, Any]]] = {"platform": platform_rows}
        query = None
        if device_for_query is not None:
            query = KernelQuery(device=device_for_query.name, dtype=device_for_query.default_dtype)
        for kind in SELECTABLE_KINDS:
            rows = []
            for cand in sorted(candidates[kind].values(), key=lambda c: (-c.priority, c.name)):
                reasons = cand.cls.unsupported_reasons(query) if query else ["no usable device platform"]
                rows.append(
                    {
                        "name": cand.name,
                        "plugin": cand.plugin,
                        "priority": cand.priority,
                        "usable": not reasons,
                        "reasons": reasons,
                    }
                )
            backends[kind] = rows
        backends["grammar"] = [
            {
                "name": c.name,
                "plugin": c.plugin,
                "priority": c.priority,
                "usable": not c.cls.unavailable_reasons(),
                "reasons": c.cls.unavailable_reasons(),
            }
            for c in sorted(candidates["grammar"].values(), key=lambda c: (-c.priority, c.name))
        ]
        backends["kv_transfer"] = [
            {"name": c.name, "plugin": c.plugin, "priority": c.priority}
            for c in sorted(candidates["kv_transfer"].values(), key=lambda c: (-c.priority, c.name))
        ]
        backends["speculative"] = [
            {
                "name": c.name,
                "plugin": c.plugin,
                "priority": c.priority,
                "usable": not c.cls.unavailable_reasons(),
                "reasons": c.cls.unavailable_reasons(),
            }
            for c in sorted(candidates["speculative"].values(), key=lambda c: (-c.priority, c.name))
        ]
        backends["tool"] = [
            {"name": c.name, "plugin": c.plugin, "priority": c.priority}
            for c in sorted(candidates["tool"].values(), key=lambda c: (-c.priority, c.name))
        ]
        backends["reasoning"] = [
            {
                "name": c.name,
                "plugin": c.plugin,
                "start": getattr(c.cls, "start", None),
                "end": getattr(c.cls, "end", None),
                "starts_in_reasoning": getattr(c.cls, "starts_in_reasoning", None),
            }
            for c in sorted(candidates["reasoning"].values(), key=lambda c: c.name)
        ]
        backends["model"] = [{"name": c.name, "plugin": c.plugin} for c in candidates["model"].values()]
        plugins = [
            {
                "name": i.name,
                "distribution": i.distribution,
                "version": i.version,
                "module": i.module,
                "hooks": i.hooks,
                "registered": i.registered,
                "error": i.error,
            }
            for i in self.plugins.values()
        ]
        return {"device_checked": query.device if query else None, "plugins": plugins, "backends": backends}


def _build_reasons(cand: Candidate) -> list[str]:
    """Why ``cand`` cannot be built here (its ``build()`` raised), else nothing."""
    try:
        cand.cls.build()
    except Exception as exc:  # a compiler error, a missing library: the backend is unusable, and says why
        logger.debug("building %s backend %s failed", cand.kind, cand.name, exc_info=True)
        return [f"build failed: {type(exc).__name__}: {exc}"]
    return []


def _log_plugin_error(what: str, error: str) -> None:
    """One line at error level (the exception's last line); the traceback, kept on
    the PluginInfo for ``radixserve plugins``, at debug."""
    logger.error("%s: %s (`radixserve plugins` shows the traceback)", what, error.splitlines()[-1])
    logger.debug("%s:\n%s", what, error)


_registry: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    global _registry
    if _registry is None:
        _registry = PluginRegistry()
    return _registry
