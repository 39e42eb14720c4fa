"""The wire format of the requests: pydantic models of the OpenAI API subset we
serve and of the SGLang-style native endpoints (the responses are in
``server/response_models.py``).

Request models check shapes, types and what the API accepts; the values of
sampling parameters are checked once, by ``SamplingParams.validate`` in the
runtime. Every request model derives from ``_Request``, which refuses (naming
the field) text that no tokenizer can take (a lone UTF-16 surrogate, anywhere in
the body) and JSON nested deeper than ``MAX_JSON_DEPTH``, and logs at DEBUG the
fields the API does not define before ignoring them (clients add new ones over
time). Integers, booleans and token ids are strict: ``"5"``, ``"yes"`` or
``true`` where those are expected is a 400, not a coercion; an integer where a
float is expected is fine. Options the OpenAI API defines but radixserve does
not implement are a 400 naming them, never silently ignored; those that change
nothing here (``user``, ``store``, ...) are accepted. SGLang/vLLM extras may
come at the top level or inside ``extra_body``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from radixserve.messages import Bootstrap
from radixserve.request_limits import has_lone_surrogate
from radixserve.sampling.params import INT64_MAX, INT64_MIN
from radixserve.server.errors import bad_request
from radixserve.structured_output.backend import GrammarSpec
from radixserve.structured_output.request_specs import CONSTRAINT_FIELDS, ConstraintError, grammar_spec

logger = logging.getLogger(__name__)


# Deeper JSON reaches recursive code (chat templates, repr) that could exhaust the
# stack; 64 levels is far more than any request, tool schemas included, needs.
MAX_JSON_DEPTH = 64


def find_bad_json(value: Any) -> tuple[str, str] | None:
    """``(path, problem)`` for the first place in a parsed JSON body that nothing
    downstream may see: a string holding a lone surrogate (JSON can carry
    ``"\\udc00"``, which no tokenizer or UTF-8 encoder accepts), or nesting
    deeper than ``MAX_JSON_DEPTH``; None when there is none. The path reads
    ``messages[0].content``, ``stop[2]``; a bad object key is reported as the
    object holding it (``""``: the body). Iterative, so no depth exhausts the
    stack; numbers are skipped and paths built only for containers and the
    culprit, so a body of millions of token ids costs little."""
    stack: list[tuple[str, Any, int, Any]] = [("", None, 0, value)]  # (parent path, key, depth, value)
    while stack:
        parent, key, depth, item = stack.pop()
        if isinstance(item, str):
            if has_lone_surrogate(item):
                return _json_path(parent, key), "not valid Unicode text (it holds a lone UTF-16 surrogate)"
            continue
        if not isinstance(item, (dict, list)):
            continue  # a number, a boolean or null at the top
        path = _json_path(parent, key)
        if depth >= MAX_JSON_DEPTH:
            return path, f"nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(item, dict):
            if any(has_lone_surrogate(k) for k in item if isinstance(k, str)):
                return path, "an object key is not valid Unicode text (it holds a lone UTF-16 surrogate)"
            entries: Any = item.items()
        else:
            entries = enumerate(item)
        children = [(path, k, depth + 1, v) for k, v in entries if isinstance(v, (str, dict, list))]
        stack.extend(reversed(children))
    return None


def _json_path(parent: str, key: Any) -> str:
    if key is None:
        return parent
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def unsupported(param: str, why: str) -> PydanticCustomError:
    """A 400 naming ``param``, for an option that radixserve does not serve (yet)."""
    return PydanticCustomError("unsupported", "{why}", {"param": param, "why": why})


@dataclass(frozen=True)
class ServedFeatures:
    """What the API serves of the options a router may route by, reported in
    ``/server_info["worker"]["features"]``. The refusals below (``unsupported``)
    are where an unserved one is a 400: flip its flag where its refusal goes."""

    structured_output: bool = True  # response_format json_object/json_schema, regex, ... (server/structured_output.py)
    tools: bool = True  # tool calling: tools with tool_choice auto / required / named (server/tool_calls.py)
    logprobs: bool = True
    n: bool = True


FEATURES = ServedFeatures()


class _Request(BaseModel):
    """Base of every request body (see the module docstring)."""

    model_config = ConfigDict(extra="ignore")
    # OpenAI clients may send ``extra_body`` literally rather than merged.
    merges_extra_body: ClassVar[bool] = False
    # OpenAI marks its optional fields nullable: null there means "unset".
    null_means_unset: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _check_raw_body(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if cls.merges_extra_body and isinstance(data.get("extra_body"), dict):
            data = {**data["extra_body"], **{k: v for k, v in data.items() if k != "extra_body"}}
        bad = find_bad_json(data)
        if bad is not None:
            raise PydanticCustomError("unacceptable_json", "{problem}", {"param": bad[0] or None, "problem": bad[1]})
        if logger.isEnabledFor(logging.DEBUG):
            unknown = sorted(k for k in data if k not in cls.model_fields)
            if unknown:
                logger.debug("%s: ignoring fields the API does not define: %s", cls.__name__, unknown)
        if cls.null_means_unset:
            data = {k: v for k, v in data.items() if v is not None}
        return data


class _OpenAIRequest(_Request):
    merges_extra_body = True
    null_means_unset = True


class _Disaggregated(BaseModel):
    """SGLang's prefill/decode fields: a gateway sends one request to a prefill and a
    decode worker with the same three, which pair the two halves."""

    bootstrap_host: str | None = None
    bootstrap_port: Int | None = None
    bootstrap_room: Int | None = None

    def bootstrap(self, prompts: int = 1) -> Bootstrap | None:
        """The three together, or None; a ValueError names a missing one, or the room
        when the request has more than one prompt: one room pairs one prompt (its ``n``
        samples get rooms of their own from it, ``Bootstrap.for_sample``)."""
        given = {"bootstrap_host": self.bootstrap_host, "bootstrap_port": self.bootstrap_port}
        given["bootstrap_room"] = self.bootstrap_room
        if all(v is None for v in given.values()):
            return None
        missing = [name for name, v in given.items() if v is None]
        if missing:
            raise ValueError(f"{missing[0]}: required with the other bootstrap fields (prefill/decode pairing)")
        if prompts != 1:
            raise ValueError(f"bootstrap_room: one room pairs one prompt; this request has {prompts}")
        assert self.bootstrap_host is not None and self.bootstrap_port is not None and self.bootstrap_room is not None
        return Bootstrap(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)


def bootstrap_of(body: _Disaggregated, prompts: int) -> Bootstrap | None:
    """``body.bootstrap(prompts)``, its ValueError a 400 naming the field."""
    try:
        return body.bootstrap(prompts)
    except ValueError as exc:
        raise bad_request(exc) from None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


_CONSTRAINT_NAMES = ("response_format", *CONSTRAINT_FIELDS, "structured_outputs")

# JSON integers are unbounded; every integer of a request fits in 64 bits (the runtime's tensors).
Int = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenIds = list[Int]


class _SamplingRequest(_OpenAIRequest, _Disaggregated):
    """Fields common to chat and text completions."""

    model: str | None = None
    max_tokens: Int | None = None
    n: Int = 1
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Accepted no-ops: they only label or route the request at OpenAI.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # radixserve's prefix cache needs no key
    # Extras (SGLang / vLLM).
    top_k: Int | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: Int | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Scheduling priority (SGLang / vLLM extra): higher is served first under
    # --schedule-policy priority; other policies ignore it.
    priority: Int = 0
    # Multi-LoRA serving (SGLang's extra): the adapter's name, as ``model`` may name it too.
    lora_path: str | None = None
    # Structured output (server/structured_output.py): OpenAI's, then SGLang's and vLLM's extras.
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    _grammar: GrammarSpec | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _read_constraint(self) -> _SamplingRequest:
        try:
            self._grammar = grammar_spec({name: getattr(self, name) for name in _CONSTRAINT_NAMES})
        except ConstraintError as exc:
            raise PydanticCustomError("invalid_constraint", "{why}", {"param": exc.param, "why": exc.detail}) from exc
        return self

    def sampling_params(self, max_tokens: int) -> dict[str, Any]:
        """The runtime's ``sampling_params`` for this request (unset fields keep
        the runtime's defaults)."""
        params: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "n": self.n,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "min_new_tokens": self.min_tokens,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": self.logit_bias,
            "grammar": self._grammar,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class TextPart(BaseModel):
    """A part of a message's content; only text exists for now."""

    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise PydanticCustomError(
                "unsupported_content",
                "content parts of type {kind} are not supported; only 'text'",
                {"kind": repr(kind)},
            )
        return kind

    @model_validator(mode="after")
    def _has_text(self) -> TextPart:
        if self.text is None:
            raise ValueError("a text part needs its 'text'")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. reasoning fields some templates read

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction

    @property
    def name(self) -> str:
        return self.function.name


class Tool(BaseModel):
    """A function the model may call (server/tool_calls.py)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    # Unset: auto with tools, none without.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None  # false: tool_choice required makes one call
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # Predicted output only speeds generation up where it is implemented; the output is the same without it.
    prediction: dict[str, Any] | None = None
    # Extras.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: StrictBool | None = None  # vLLM's; refused when true
    _named_tool: str | None = PrivateAttr(default=None)

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice names."""
        return self._named_tool

    @model_validator(mode="after")
    def _refuse_unserved(self) -> ChatCompletionRequest:
        """OpenAI options that radixserve does not implement are a 400, never ignored."""
        if isinstance(self.tool_choice, dict):
            try:
                self._named_tool = NamedToolChoice.model_validate(self.tool_choice).name
            except ValueError:
                raise unsupported(
                    "tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}'
                ) from None
        if not self.tools and self.tool_choice not in (None, "none"):
            raise unsupported("tool_choice", "tool_choice 'required' or a named function needs tools")
        if self.tools and self.tool_choice not in (None, "none", "auto") and self._grammar is not None:
            raise unsupported(
                "tool_choice", f"tool_choice required or named cannot be combined with {self._grammar.source}"
            )
        if self.functions:
            raise unsupported("functions", "function calling is not supported yet")
        if self.function_call not in (None, "none", "auto"):
            raise unsupported("function_call", "function calling is not supported yet")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise unsupported("modalities", "only the 'text' modality is served")
        for name in ("audio", "reasoning_effort", "verbosity", "web_search_options"):
            if getattr(self, name) is not None:
                raise unsupported(name, f"{name} is not supported")
        if self.echo:
            raise unsupported("echo", "echo is not supported on chat completions; use /v1/completions")
        return self


Prompt = str | list[str] | TokenIds | list[TokenIds]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    best_of: Int | None = None  # only best_of == n (no extra candidates) is served
    suffix: str | None = None  # insertion is not served; refused unless empty

    @model_validator(mode="after")
    def _refuse_unserved(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported(
                "best_of", f"best_of must equal n ({self.n}): choosing the best of extra candidates is not supported"
            )
        if self.suffix:
            raise unsupported("suffix", "suffix (text insertion) is not supported")
        return self


class EmbeddingRequest(_OpenAIRequest):
    """POST /v1/embeddings (server/embeddings.py)."""

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None  # Matryoshka truncation, where the model is marked for it
    user: str | None = None  # accepted no-op, as in the other OpenAI requests


class GenerateRequestBody(_Request, _Disaggregated):
    """POST /generate, SGLang's native API: one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: Int = 0
    logprob_start_len: Int = -1
    rid: str | list[str] | None = None
    # Higher is served first under --schedule-policy priority; one for all prompts or one per prompt.
    priority: Int | list[Int] = 0
    # Multi-LoRA serving: the adapter's name (None: the base model); one for all prompts or one per prompt.
    lora_path: str | list[str | None] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds
    skip_special_tokens: StrictBool = True


class AbortRequestBody(_Request):
    rid: str


class LoadLoRAAdapterBody(_Request):
    """POST /load_lora_adapter (and vLLM's /v1/load_lora_adapter)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterBody(_Request):
    """POST /unload_lora_adapter (and vLLM's /v1/unload_lora_adapter)."""

    lora_name: str


class StartProfileBody(_Request):
    """POST /start_profile (the body is optional): ``ProfileOptions``' fields."""

    output_dir: str | None = None
    record_shapes: StrictBool = False
    num_steps: Int | None = None
