"""What the built-in backends share: how a spec reads for a compiler."""

from __future__ import annotations

import importlib.util
import json

from radixserve.structured_output.backend import GrammarError, GrammarSpec

# Any JSON object; the backends emit JSON without free whitespace (see json_separators).
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def missing_module(module: str, package: str) -> list[str]:
    if importlib.util.find_spec(module) is None:
        return [f"the {package!r} package is not installed (pip install {package})"]
    return []


def schema_text(spec: GrammarSpec) -> str:
    """The JSON schema of a json_schema or json_object spec."""
    return JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.text


def choices(spec: GrammarSpec) -> list[str]:
    """The strings of a choice spec (a JSON list of strings)."""
    try:
        values = json.loads(spec.text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"choices are not JSON: {exc}") from exc
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise GrammarError("choices must be a non-empty list of strings")
    return values
