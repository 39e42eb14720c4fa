"""/v1/chat/completions and /v1/completions on top of the TokenizerManager.

A request becomes one ``GenerateInput`` per prompt (the runtime fans out ``n``);
choice ``i`` of prompt ``p`` is choice ``p * n + i`` of the response. Streams
wait for the first result before sending headers (so a full queue is still a
503) and end with ``data: [DONE]``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, cast

from fastapi import Request
from fastapi.responses import StreamingResponse

from radixserve.messages import FinishReason, FinishType
from radixserve.reasoning_parsers.base import ReasoningParser
from radixserve.server.chat_template import ChatTemplate
from radixserve.server.errors import APIError
from radixserve.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from radixserve.server.lora import ServedAdapters
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, bootstrap_of
from radixserve.server.response_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatFinishType,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    MatchedStop,
    PromptTokensDetails,
    Usage,
)
from radixserve.server.streaming import (
    EventStreamResponse,
    Tagged,
    cancel_on_disconnect,
    collect,
    first_and_rest,
    runtime_errors,
    start_generation,
)
from radixserve.server.tokenizer_manager import GenerateInput, TokenizerManager
from radixserve.server.tool_calls import ChoiceReader, check_tools, keeps_special_tokens, tool_grammar
from radixserve.structured_output.backend import ReasoningGate
from radixserve.tool_parsers.base import ToolParser

# Without max_tokens a request may use the rest of the context (as in vLLM), up
# to this many tokens so one request cannot reserve a long model's whole window.
DEFAULT_MAX_TOKENS_CAP = 16384

_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
CHAT_RENAMES = {**_RENAMES, "input_ids": "messages"}
COMPLETION_RENAMES = {**_RENAMES, "input_ids": "prompt"}


@dataclass(frozen=True)
class Echo:
    """A prompt as ``echo`` shows it; ``lead``/``trail`` tokens the tokenizer
    added before/after it are not part of ``text``."""

    text: str
    lead: int = 0
    trail: int = 0


def finish_fields(meta: dict[str, Any]) -> tuple[FinishType | None, MatchedStop]:
    """The runtime's ``FinishReason`` as OpenAI's ``finish_reason`` and our ``matched_stop``."""
    reason: FinishReason | None = meta["finish_reason"]
    if reason is None:
        return None, None
    return reason.type, reason.matched if reason.type == "stop" else None


class UsageCounter:
    """Token counts over the choices of a request: each prompt counts once,
    completions add up, cached prompt tokens are the least any choice of that
    prompt got (the others may have hit the first one's cache)."""

    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, prompt_index: int, choice_index: int, meta: dict[str, Any]) -> None:
        self.prompt[prompt_index] = meta["prompt_tokens"]
        self.cached[prompt_index] = min(self.cached.get(prompt_index, math.inf), meta["cached_tokens"])
        self.completion[choice_index] = meta["completion_tokens"]

    def total(self) -> Usage:
        return make_usage(sum(self.prompt.values()), sum(self.completion.values()), sum(self.cached.values()))


def make_usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class OpenAIServing:
    def __init__(
        self,
        tm: TokenizerManager,
        model_name: str,
        chat_template: ChatTemplate,
        adapters: ServedAdapters,
        tool_parser: type[ToolParser] | None = None,
        reasoning_parser: type[ReasoningParser] | None = None,
    ):
        self.tm = tm
        self.model_name = model_name
        self.adapters = adapters
        self.chat_template = chat_template
        self.texts = TokenTexts(tm.tokenizer)
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.gate: ReasoningGate | None = None
        if reasoning_parser is not None:
            encode = tm.tokenizer.encode
            self.gate = ReasoningGate(
                tuple(encode(reasoning_parser.start, add_special_tokens=False)),
                tuple(encode(reasoning_parser.end, add_special_tokens=False)),
                reasoning_parser.starts_in_reasoning,
            )

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); a 404 naming
        ``model`` when it is neither the base model nor a loaded adapter."""
        return self.adapters.resolve(model, None, self.model_name)

    def _check_request(self, req: ChatCompletionRequest | CompletionRequest) -> str | None:
        """The request's adapter (None: the base model), after checking what it asks."""
        adapter = self.adapters.resolve(req.model, req.lora_path, self.model_name)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
        return adapter

    def _answering(self, req: ChatCompletionRequest | CompletionRequest) -> str:
        """The ``model`` a response names: the adapter a request named by ``model``, else the base."""
        named_adapter = req.model is not None and req.model != self.model_name and req.lora_path is None
        return req.model if named_adapter and req.model is not None else self.model_name

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        if requested is not None:
            return requested
        # The rest of the context, within what the KV pool can hold for one request.
        room = min(self.tm.context_length, self.tm.kv_pool_tokens // self.tm.page_size * self.tm.page_size)
        return max(min(room - prompt_len, DEFAULT_MAX_TOKENS_CAP), 0)

    # ---- chat --------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request: Request) -> ChatCompletionResponse | StreamingResponse:
        adapter = self._check_request(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise APIError(
                400, "continue_final_message: the last message must be the assistant's", param="continue_final_message"
            )
        check_tools(req)
        bootstrap = bootstrap_of(req, 1)
        with runtime_errors(CHAT_RENAMES):
            ids = self.chat_template.encode(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = req.sampling_params(self._max_tokens(requested, len(ids)))
        if req.tools:
            grammar = tool_grammar(req)
            if grammar is not None:
                params["grammar"] = grammar
        if keeps_special_tokens(req, self.tool_parser):
            params["skip_special_tokens"] = False
        if self.gate is not None and params.get("grammar") is not None:
            params["grammar_gate"] = self.gate
        inp = GenerateInput(
            input_ids=ids,
            sampling_params=params,
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            stream=req.stream,
            rid=rid,
            priority=req.priority,
            bootstrap=bootstrap,
            lora_name=adapter,
        )
        results = start_generation(self.tm, [inp], CHAT_RENAMES)
        if req.stream:
            results = await first_and_rest(results, request, CHAT_RENAMES)
            return EventStreamResponse(self._chat_chunks(req, rid, results))
        with runtime_errors(CHAT_RENAMES):
            outs = await cancel_on_disconnect(request, collect(results, CHAT_RENAMES))
        usage = UsageCounter()
        choices = []
        finish: ChatFinishType | None
        for _, out in sorted(outs, key=lambda item: item[1]["index"]):
            meta = out["meta_info"]
            usage.add(0, out["index"], meta)
            finish, matched = finish_fields(meta)
            reasoning, content, calls = self._reader(req).read(out["text"])
            if calls and finish == "stop":
                finish = "tool_calls"
            choices.append(
                ChatChoice(
                    index=out["index"],
                    message=AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None),
                    logprobs=self._chat_logprobs(meta) if req.logprobs else None,
                    finish_reason=finish,
                    matched_stop=matched,
                )
            )
        return ChatCompletionResponse(id=rid, model=self._answering(req), choices=choices, usage=usage.total())

    def _reader(self, req: ChatCompletionRequest) -> ChoiceReader:
        return ChoiceReader(req, self.tool_parser, self.reasoning_parser)

    def _chat_logprobs(self, meta: dict[str, Any]) -> ChatLogprobs:
        return chat_logprobs(self.texts, meta["output_token_logprobs"], meta["output_top_logprobs"])

    async def _chat_chunks(
        self, req: ChatCompletionRequest, rid: str, results: AsyncGenerator[Tagged, None]
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=rid, created=created, model=self._answering(req), choices=choices, usage=usage
            )

        for index in range(req.n):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        usage = UsageCounter()
        readers: dict[int, ChoiceReader] = {}
        finish: ChatFinishType | None
        async for _, out in results:
            meta = out["meta_info"]
            usage.add(0, out["index"], meta)
            finish, matched = finish_fields(meta)
            reader = readers.setdefault(out["index"], self._reader(req))
            reasoning, content, calls = reader.feed(out["text"], final=finish is not None)
            if reader.called and finish == "stop":
                finish = "tool_calls"
            if not (reasoning or content or calls) and finish is None and not meta["output_token_logprobs"]:
                continue  # nothing to tell (e.g. a token that completes no character yet)
            choice = ChatStreamChoice(
                index=out["index"],
                delta=DeltaMessage(
                    content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None
                ),
                logprobs=self._chat_logprobs(meta) if req.logprobs else None,
                finish_reason=finish,
                matched_stop=matched,
            )
            running = (
                make_usage(meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"])
                if req.continuous_usage
                else None
            )
            yield chunk([choice], running)
        if req.include_usage:
            yield chunk([], usage.total())

    # ---- completions ---------------------------------------------------------------
    @staticmethod
    def _raw_prompts(req: CompletionRequest) -> list[str | list[int]]:
        """The prompt(s) as given: strings or lists of token ids."""
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [cast(list[int], prompt)]  # every item an int: one prompt of token ids
        else:
            prompts = list(cast(list[str] | list[list[int]], prompt))  # a batch
        if not prompts:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        return prompts

    def _echo(self, given: str | list[int], ids: list[int]) -> Echo:
        """What ``echo`` shows of a prompt: the prompt as given (a text prompt
        verbatim, token ids decoded as they are), and for a text prompt the
        counts of tokens the tokenizer added around it (a BOS, say), which are
        not in that text and so are left out of the echoed logprobs."""
        if not isinstance(given, str):
            return Echo(self.tm.tokenizer.decode(ids, skip_special_tokens=False))
        plain = list(self.tm.tokenizer.encode(given, add_special_tokens=False))
        extra = len(ids) - len(plain)
        if extra > 0:
            for lead in range(extra + 1):
                if ids[lead : lead + len(plain)] == plain:
                    return Echo(given, lead, extra - lead)
        return Echo(given)

    async def completions(self, req: CompletionRequest, request: Request) -> CompletionResponse | StreamingResponse:
        adapter = self._check_request(req)
        given = self._raw_prompts(req)
        # Text is tokenized like the native API does.
        prompts = [self.tm.tokenize(p) if isinstance(p, str) else list(p) for p in given]
        bootstrap = bootstrap_of(req, len(prompts))
        rid = f"cmpl-{uuid.uuid4().hex}"
        want_logprobs = req.logprobs is not None
        inputs = [
            GenerateInput(
                input_ids=ids,
                sampling_params=req.sampling_params(self._max_tokens(req.max_tokens, len(ids))),
                return_logprob=want_logprobs,
                top_logprobs_num=req.logprobs or 0,
                logprob_start_len=0 if (req.echo and want_logprobs) else -1,
                stream=req.stream,
                rid=rid if len(prompts) == 1 else f"{rid}-{p}",
                priority=req.priority,
                bootstrap=bootstrap,
                lora_name=adapter,
            )
            for p, ids in enumerate(prompts)
        ]
        results = start_generation(self.tm, inputs, COMPLETION_RENAMES)
        echoes = [self._echo(g, ids) if req.echo else Echo("") for g, ids in zip(given, prompts, strict=True)]
        if req.stream:
            results = await first_and_rest(results, request, COMPLETION_RENAMES)
            return EventStreamResponse(self._completion_chunks(req, rid, results, echoes))
        with runtime_errors(COMPLETION_RENAMES):
            outs = await cancel_on_disconnect(request, collect(results, COMPLETION_RENAMES))
        usage = UsageCounter()
        choices = []
        for p, out in outs:
            index = p * req.n + out["index"]
            meta = out["meta_info"]
            usage.add(p, index, meta)
            finish, matched = finish_fields(meta)
            logprobs = self._completion_logprobs(meta, echoes[p] if req.echo else None, 0)[0] if want_logprobs else None
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echoes[p].text + out["text"],
                    logprobs=logprobs,
                    finish_reason=finish,
                    matched_stop=matched,
                )
            )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=rid, model=self._answering(req), choices=choices, usage=usage.total())

    def _completion_logprobs(
        self, meta: dict[str, Any], echo: Echo | None, offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Logprobs of the new tokens, preceded with ``echo`` by those of the echoed
        prompt (without the tokens the tokenizer added, which the echo lacks)."""
        tokens, tops = list(meta["output_token_logprobs"]), list(meta["output_top_logprobs"])
        if echo is not None and meta.get("input_token_logprobs") is not None:
            prompt_tokens, prompt_tops = list(meta["input_token_logprobs"]), list(meta["input_top_logprobs"])
            end = len(prompt_tokens) - echo.trail
            tokens = prompt_tokens[echo.lead : end] + tokens
            tops = prompt_tops[echo.lead : end] + tops
        return completion_logprobs(self.texts, tokens, tops, offset)

    async def _completion_chunks(
        self, req: CompletionRequest, rid: str, results: AsyncGenerator[Tagged, None], echoes: list[Echo]
    ) -> AsyncGenerator[CompletionResponse, None]:
        created = int(time.time())
        usage = UsageCounter()
        started: set[int] = set()  # choices that sent their first chunk (with the echo)
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        async for p, out in results:
            index = p * req.n + out["index"]
            meta = out["meta_info"]
            usage.add(p, index, meta)
            finish, matched = finish_fields(meta)
            first = index not in started
            started.add(index)
            text = (echoes[p].text if first else "") + out["text"]
            logprobs = None
            if req.logprobs is not None:
                echo = echoes[p] if req.echo and first else None
                logprobs, offsets[index] = self._completion_logprobs(meta, echo, offsets.get(index, 0))
            if not text and finish is None and not (logprobs and logprobs.tokens):
                continue
            running = (
                make_usage(meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"])
                if req.continuous_usage
                else None
            )
            yield CompletionResponse(
                id=rid,
                created=created,
                model=self._answering(req),
                usage=running,
                choices=[
                    CompletionChoice(
                        index=index, text=text, logprobs=logprobs, finish_reason=finish, matched_stop=matched
                    )
                ],
            )
        if req.include_usage:
            yield CompletionResponse(
                id=rid, created=created, model=self._answering(req), choices=[], usage=usage.total()
            )
