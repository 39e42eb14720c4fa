"""The LoRA adapters the server offers (multi-LoRA serving): which one a request
names, the adapters' model cards, and their loading and unloading at run time.

A request names an adapter by its OpenAI ``model`` (the adapter's name, or
``BASE:ADAPTER`` as SGLang writes it) or by SGLang's ``lora_path`` (the
adapter's name). The scheduler checks again when the request arrives there (an
unload may have come between), so this front-door check is for the error's
field and status, not for safety.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.server.errors import APIError
from radixserve.server.response_models import ModelCard
from radixserve.server.tokenizer_manager import TokenizerManager

LORA_OFF = "LoRA is off; start the server with --enable-lora"


@dataclass
class ServedAdapters:
    """Adapter name -> path, as the scheduler last confirmed (``enabled``: --enable-lora)."""

    enabled: bool
    paths: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_summary(cls, summary: dict[str, Any]) -> ServedAdapters:
        lora = summary.get("lora")
        if lora is None:
            return cls(False)
        return cls(True, {a["name"]: a["path"] for a in lora["adapters"]})

    def resolve(self, model: str | None, lora_path: str | None, base_name: str) -> str | None:
        """The adapter a request names (None: the base model); an APIError names the
        field when it names one that is not loaded (404 for ``model``, OpenAI's way)."""
        if lora_path is not None:
            if not self.enabled:
                raise APIError(400, f"lora_path: {LORA_OFF}", param="lora_path")
            if lora_path not in self.paths:
                raise APIError(400, f"lora_path: {self._unknown(lora_path)}", param="lora_path")
            return lora_path
        if model is None or model == base_name:
            return None
        name = model.removeprefix(f"{base_name}:")
        if name in self.paths:
            return name
        served = [base_name, *sorted(self.paths)]
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )

    def _unknown(self, name: str) -> str:
        return f"no adapter named {name!r} is loaded (loaded: {sorted(self.paths)})"

    def cards(self, base_name: str, max_model_len: int) -> list[ModelCard]:
        """One card per adapter, its base as ``parent`` (vLLM's listing)."""
        return [
            ModelCard(id=name, root=path, parent=base_name, max_model_len=max_model_len)
            for name, path in sorted(self.paths.items())
        ]

    async def load(self, tm: TokenizerManager, name: str, path: str, base_name: str) -> None:
        """Load ``name`` on every replica; a name a request could not tell from the base
        model (its name, or one with ``:``, ``BASE:ADAPTER``'s separator) is refused."""
        if not self.enabled:
            raise APIError(400, f"lora_name: {LORA_OFF}", param="lora_name")
        if name == base_name or ":" in name:
            raise APIError(400, f"lora_name: {name!r} is the served model's name or has a ':'", param="lora_name")
        self._check(await tm.control("load_lora_adapter", args={"lora_name": name, "lora_path": path}))
        self.paths[name] = path

    async def unload(self, tm: TokenizerManager, name: str) -> None:
        if not self.enabled:
            raise APIError(400, f"lora_name: {LORA_OFF}", param="lora_name")
        self._check(await tm.control("unload_lora_adapter", args={"lora_name": name}))
        self.paths.pop(name, None)

    @staticmethod
    def _check(reply: dict[str, Any]) -> None:
        if "error" in reply:
            field_name = reply.get("field", "lora_name")
            raise APIError(400, f"{field_name}: {reply['error']}", param=field_name)
