"""Structured output at the API edge: every way a request may ask for it, read
into one ``GrammarSpec`` whose ``source`` names the field it came from.

- OpenAI: ``response_format`` ``{"type": "text" | "json_object" | "json_schema",
  "json_schema": {"name", "schema", "strict"}}``;
- SGLang: ``regex``, ``json_schema``, ``ebnf`` (top-level extras on the OpenAI
  routes; in ``sampling_params`` on ``/generate``);
- vLLM: ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  and ``structured_outputs`` ``{"json" | "regex" | "choice" | "grammar": ...}``
  (or ``{"json_object": true}``).

More than one constraint in a request is an error naming the fields. Whether
a schema, regex or grammar is valid is the compiler's to say (in the scheduler).
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.structured_output.backend import GrammarKind, GrammarSpec

# Extras naming a constraint directly: field -> grammar kind.
CONSTRAINT_FIELDS: dict[str, GrammarKind] = {
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "ebnf",
}
# SGLang's names of the constraints in /generate's (and the Engine's) sampling_params.
SAMPLING_PARAMS_FIELDS = ("json_schema", "regex", "ebnf")
# vLLM's structured_outputs keys.
_STRUCTURED_OUTPUTS: dict[str, GrammarKind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "ebnf",
}


class ConstraintError(ValueError):
    """A malformed or ambiguous constraint; ``param`` names the field."""

    def __init__(self, param: str, detail: str):
        super().__init__(f"{param}: {detail}")
        self.param, self.detail = param, detail


def grammar_spec(fields: dict[str, Any], prefix: str = "") -> GrammarSpec | None:
    """The constraint among ``fields`` (a request's set fields; None counts as
    unset), or None; ``prefix`` is put before field names in messages
    (``sampling_params.``)."""
    found: list[GrammarSpec] = []
    response_format = fields.get("response_format")
    if response_format is not None:
        spec = _response_format(response_format, prefix + "response_format")
        if spec is not None:
            found.append(spec)
    for name, kind in CONSTRAINT_FIELDS.items():
        if fields.get(name) is not None:
            found.append(_spec(kind, fields[name], prefix + name))
    structured = fields.get("structured_outputs")
    if structured is not None:
        found.extend(_structured_outputs(structured, prefix + "structured_outputs"))
    if len(found) > 1:
        names = ", ".join(s.source for s in found)
        raise ConstraintError(found[0].source, f"give one structured output constraint per request, got {names}")
    return found[0] if found else None


def take_sampling_grammar(params: dict[str, Any]) -> None:
    """Replace SGLang's constraint fields of a ``sampling_params`` dict by the
    runtime's ``grammar`` (a GrammarSpec); ConstraintError names the field."""
    grammar = grammar_spec({name: params.pop(name, None) for name in SAMPLING_PARAMS_FIELDS}, "sampling_params.")
    if grammar is not None:
        params["grammar"] = grammar


def _spec(kind: GrammarKind, value: Any, source: str) -> GrammarSpec:
    if kind == "json_schema" and isinstance(value, dict):
        value = json.dumps(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ConstraintError(source, "must be a non-empty list of strings")
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ConstraintError(source, f"must be a string, got {type(value).__name__}")
    return GrammarSpec(kind, value, source)


def _response_format(value: Any, source: str) -> GrammarSpec | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", source)
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict):
            raise ConstraintError(source, "a json_schema response_format needs its 'json_schema' object")
        if schema.get("schema") is None:  # OpenAI's schema is optional: any JSON object
            return GrammarSpec("json_object", "", source)
        return _spec("json_schema", schema["schema"], source)
    raise ConstraintError(source, f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _structured_outputs(value: Any, source: str) -> list[GrammarSpec]:
    if not isinstance(value, dict):
        raise ConstraintError(source, "must be an object")
    served = {*_STRUCTURED_OUTPUTS, "json_object"}
    unknown = sorted(set(value) - served)
    if unknown:
        raise ConstraintError(source, f"unsupported key(s) {unknown}; served: {sorted(served)}")
    specs = [
        _spec(kind, value[k], f"{source}.{k}") for k, kind in _STRUCTURED_OUTPUTS.items() if value.get(k) is not None
    ]
    if value.get("json_object"):
        specs.append(GrammarSpec("json_object", "", f"{source}.json_object"))
    return specs
