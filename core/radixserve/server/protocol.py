"""The wire format: pydantic models of the OpenAI API subset we serve and of the
SGLang-style native endpoints.

Request models check shapes and API-level limits only; the values of sampling
parameters are checked once, by ``SamplingParams.validate`` in the runtime.
Unknown request fields are ignored, as OpenAI does; SGLang/vLLM extras may come
at the top level or inside ``extra_body``.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# ---------------------------------------------------------------------------
# Requests


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        """Some clients send ``extra_body`` literally rather than merged."""
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            data = {**data["extra_body"], **{k: v for k, v in data.items() if k != "extra_body"}}
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_OpenAIRequest):
    """Fields common to chat and text completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Extras (SGLang / vLLM).
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Scheduling priority (SGLang / vLLM extra): higher is served first under
    # --schedule-policy priority; other policies ignore it.
    priority: int = 0

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
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. reasoning fields some templates read

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    # Extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False


class GenerateRequestBody(BaseModel):
    """POST /generate, SGLang's native API: one prompt or a batch."""

    model_config = ConfigDict(extra="ignore")

    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    rid: Union[str, list[str], None] = None
    # Higher is served first under --schedule-policy priority; one for all prompts or one per prompt.
    priority: Union[int, list[int]] = 0


class TokenizeRequest(BaseModel):
    model: Optional[str] = None
    prompt: Union[str, list[str]]
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: Optional[str] = None
    tokens: list[int]
    skip_special_tokens: bool = True


class AbortRequestBody(BaseModel):
    rid: str


# ---------------------------------------------------------------------------
# Responses


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


FinishReason = Optional[Literal["stop", "length", "abort"]]
MatchedStop = Union[int, str, None]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: FinishReason
    matched_stop: MatchedStop = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

    @model_serializer
    def _present_fields_only(self) -> dict[str, Any]:
        # A delta holds only what changed: {"role": ...} first, then {"content": ...}, finally {}.
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: FinishReason = None
    matched_stop: MatchedStop = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: FinishReason = None
    matched_stop: MatchedStop = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "radixserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
