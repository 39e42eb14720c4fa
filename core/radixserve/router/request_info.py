"""What the router reads from a request before routing it: from its body, the model, the
LoRA adapter its ``lora_path`` names, whether it streams, the features it needs from a
worker (the field that needs each, for the error), and its routing text with estimated
token counts; from its headers, the latency objectives it states. The body itself is
forwarded as it came."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from radixserve.router.latency import LatencyObjective
from radixserve.router.policies import RoutingRequest
from radixserve.server.errors import APIError

# Output tokens assumed for a request that does not bound them.
DEFAULT_MAX_TOKENS = 256
# The routes whose requests the router reads (model, features, routing text).
ROUTED_BY_TEXT = ("chat", "completions", "generate", "embeddings")
_PROMPT_TOKENS_KEY = b'"prompt_tokens":'
# The headers stating a request's latency objectives, in milliseconds (llm-d's names).
TTFT_OBJECTIVE_HEADER, TPOT_OBJECTIVE_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"
_GUIDED_FIELDS = ("regex", "ebnf", "json_schema", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass
class RequestInfo:
    model: str | None  # as the request names it: a served model, or a LoRA adapter (``lora.AdapterRouting``)
    stream: bool
    lora_path: str | None = None  # the adapter its ``lora_path`` names
    needs: dict[str, str] = field(default_factory=dict)  # feature -> the request field that needs it
    routing: RoutingRequest = RoutingRequest("", 0, 0)


class TokenEstimator:
    """Characters per token, learned from the workers' usage reports (4 until then)."""

    def __init__(self) -> None:
        self.chars_per_token = 4.0

    def tokens(self, text: str) -> int:
        return max(1, round(len(text) / self.chars_per_token))

    def learn(self, text: str, prompt_tokens: int) -> None:
        if prompt_tokens > 0 and len(text) >= 16:
            self.chars_per_token = 0.9 * self.chars_per_token + 0.1 * (len(text) / prompt_tokens)


def usage_prompt_tokens(answer: bytes) -> int | None:
    """``usage.prompt_tokens`` of a whole JSON answer, found from its end (where the
    usage object is) without parsing the rest; None without one. Text inside the
    answer cannot fake it: its quotes are escaped."""
    at = answer.rfind(_PROMPT_TOKENS_KEY)
    if at < 0:
        return None
    value = answer[at + len(_PROMPT_TOKENS_KEY) : at + len(_PROMPT_TOKENS_KEY) + 24].lstrip()
    end = 0
    while end < len(value) and value[end : end + 1].isdigit():
        end += 1
    return int(value[:end]) if end else None


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object")
    return payload


def read_request(
    route: str, payload: dict[str, Any], estimator: TokenEstimator, objective: LatencyObjective | None = None
) -> RequestInfo:
    """What routing needs of a request to ``route`` (``objective``: its headers',
    ``latency_objective``); one without routing text (tokenize, detokenize) may go to
    any worker of its model."""
    if route not in ROUTED_BY_TEXT:
        model = payload.get("model")
        return RequestInfo(model=model if isinstance(model, str) else None, stream=False)
    sampling = payload.get("sampling_params") if route == "generate" else payload
    sampling = sampling if isinstance(sampling, dict) else {}
    text = _routing_text(route, payload)
    if route == "embeddings":
        max_tokens: int | None = 1  # a prefill alone
    else:
        max_tokens = _first_int(sampling, ("max_tokens", "max_completion_tokens", "max_new_tokens"))
    model = payload.get("model")
    if route != "generate" and not isinstance(model, str):
        raise APIError(400, "model: field required (a string naming a served model)", param="model")
    return RequestInfo(
        model=model if isinstance(model, str) else None,
        stream=bool(payload.get("stream")),
        lora_path=_lora_path(payload.get("lora_path")),
        needs=_needs(route, payload, sampling),
        routing=RoutingRequest(text, estimator.tokens(text), max_tokens or DEFAULT_MAX_TOKENS, objective),
    )


def latency_objective(headers: list[tuple[bytes, bytes]]) -> LatencyObjective | None:
    """The objectives a request's headers state (None: none); a value that is not a
    positive number of milliseconds is a 400 naming the header."""
    found: dict[str, float] = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        if name not in (TTFT_OBJECTIVE_HEADER, TPOT_OBJECTIVE_HEADER):
            continue
        value = raw_value.decode("latin-1").strip()
        try:
            ms = float(value)
        except ValueError:
            ms = 0.0
        if not 0 < ms < math.inf:  # NaN too
            raise APIError(400, f"{name}: {value!r} is not a positive number of milliseconds", param=name)
        found[name] = ms / 1000
    if not found:
        return None
    return LatencyObjective(ttft_s=found.get(TTFT_OBJECTIVE_HEADER), tpot_s=found.get(TPOT_OBJECTIVE_HEADER))


def _lora_path(value: Any) -> str | None:
    """The adapter a request's ``lora_path`` names. /generate's may name one per prompt (None:
    the base model): the adapter when every prompt that names one names the same (the
    others run on the base model, which every worker has), else None (no preference)."""
    if isinstance(value, list):
        named = {name for name in value if isinstance(name, str)}
        return named.pop() if len(named) == 1 else None
    return value if isinstance(value, str) else None


def _needs(route: str, payload: dict[str, Any], sampling: dict[str, Any]) -> dict[str, str]:
    """The features (``worker.FEATURES``) a request needs, each with the field that needs it."""
    if route == "embeddings":
        return {"embeddings": "model"}
    needs: dict[str, str] = {"generation": "model"}
    response_format = payload.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        needs["structured_output"] = "response_format"
    for where in (sampling, payload):
        for name in (*_GUIDED_FIELDS, "structured_outputs"):
            if where.get(name) not in (None, "", {}, []):
                needs.setdefault("structured_output", name)
    if payload.get("tools") and payload.get("tool_choice") != "none":
        needs["tools"] = "tools"
    for name in ("logprobs", "top_logprobs", "return_logprob"):
        if payload.get(name) not in (None, False, 0):
            needs.setdefault("logprobs", name)
    n = sampling.get("n", 1)
    if isinstance(n, int) and n > 1:
        needs["n"] = "n"
    return needs


def _routing_text(route: str, payload: dict[str, Any]) -> str:
    """The text whose prefix decides cache affinity; its shape only has to be the same for
    requests that share a prefix (a conversation and its continuation, a shared system prompt)."""
    if route == "chat":
        parts = []
        for message in payload.get("messages") or []:
            if isinstance(message, dict):
                parts.append(f"{message.get('role', '')}\x1f{_content_text(message.get('content'))}\x1e")
        return "".join(parts)
    if route == "generate":
        source = payload.get("text", payload.get("input_ids"))
    else:
        source = payload.get("prompt" if route == "completions" else "input")
    if isinstance(source, list) and source and not isinstance(source[0], int):
        source = source[0]  # a batch: its first prompt stands for it
    if isinstance(source, list):
        return ",".join(str(token) for token in source)
    return source if isinstance(source, str) else ""


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _first_int(where: dict[str, Any], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = where.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
