"""The offline API, in the style of ``sglang.Engine``: the same processes as the
server (scheduler, detokenizer, tokenizer manager), without HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from radixserve.checkpoints.source import open_gguf_model, resolve_model_path
from radixserve.config import ServerArgs
from radixserve.messages import ProfileOptions
from radixserve.runtime.processes.spawn import launch_runtime
from radixserve.server.tokenizer_manager import GenerateInput, TokenizerManager
from radixserve.structured_output.request_specs import take_sampling_grammar

if TYPE_CHECKING:  # transformers: imported where a tokenizer is loaded
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
Params = dict[str, Any] | list[dict[str, Any]] | None
Result = dict[str, Any]
T = TypeVar("T")
# What ``encode`` reports of each embedding request.
_ENCODE_META = ("id", "prompt_tokens", "cached_tokens", "finish_reason")


class Engine:
    """``Engine(model_path=..., **server_args)``; every ServerArgs field is a keyword
    (``dp_size=N``: N replicas behind the data-parallel controller, as the server)."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.args = open_gguf_model(ServerArgs.from_kwargs(model_path=model_path, **kwargs))
        self.model_path = resolve_model_path(self.args)
        self._runtime = launch_runtime(self.args, self.model_path)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="engine-loop")
        self._thread.start()
        try:
            self.tokenizer_manager = self._call(self._make_tokenizer_manager())
        except BaseException:
            self._runtime.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise

        def on_death(reason: str) -> None:
            self._loop.call_soon_threadsafe(self.tokenizer_manager.fail_all, reason)

        self._runtime.watch(on_death)
        self._closed = False

    async def _make_tokenizer_manager(self) -> TokenizerManager:
        summary = self._runtime.summary
        tm = TokenizerManager(self.args, self._runtime.tokenizer, self._runtime.endpoints, summary)
        tm.start()
        return tm

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer: PreTrainedTokenizerBase = self.tokenizer_manager.tokenizer
        return tokenizer

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self._call(self.tokenizer_manager.control("server_info"))
        return info

    def flush_cache(self) -> bool:
        flushed: bool = self._call(self.tokenizer_manager.control("flush_cache"))
        return flushed

    def start_profile(
        self, output_dir: str | None = None, record_shapes: bool = False, num_steps: int | None = None
    ) -> str:
        """Profile the scheduler process (torch.profiler, the platform's activities)
        from its next step on; returns the path the Chrome trace will be written to:
        ``output_dir`` (default ``$RADIXSERVE_PROFILE_DIR``, else a new temporary
        directory). With ``num_steps`` it stops by itself after that many steps.
        ValueError: already profiling, or a bad argument (named)."""
        return self._call(self.tokenizer_manager.start_profile(ProfileOptions(output_dir, record_shapes, num_steps)))

    def stop_profile(self) -> str:
        """Stop the profile (if it has not stopped by itself) and return its trace
        path. ValueError when no profile was started since the last stop."""
        return self._call(self.tokenizer_manager.stop_profile())

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: InputIds = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        rid: str | None = None,
        priority: int = 0,
        lora_path: str | list[str | None] | None = None,
    ) -> Result | list[Any] | Iterator[Result]:
        """A dict for one prompt, a list for a batch (a list per prompt when n > 1);
        with ``stream=True`` an iterator of incremental results (text deltas).
        ``priority``: higher is served first under ``schedule_policy="priority"``.
        ``lora_path``: the LoRA adapter (its name) each prompt runs under, one for all
        or one per prompt (None: the base model; ``enable_lora`` serves adapters)."""
        if prompt is not None and input_ids is not None:
            raise ValueError("prompt: give either prompt or input_ids, not both")
        is_batch = isinstance(prompt, list) or (
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        )
        texts = (prompt if isinstance(prompt, list) else [prompt]) if prompt is not None else None
        ids = _id_lists(input_ids, is_batch) if input_ids is not None else None
        count = len(texts if texts is not None else ids if ids is not None else [None])
        given: Sequence[dict[str, Any] | None] = _per_prompt(sampling_params, count, "sampling_params")
        adapters: Sequence[str | None] = _per_prompt(lora_path, count, "lora_path")
        params = [dict(p or {}) for p in given]
        for p in params:
            take_sampling_grammar(p)  # json_schema / regex / ebnf, as SGLang's Engine takes them
        inputs = [
            GenerateInput(
                text=texts[i] if texts is not None else None,
                input_ids=ids[i] if ids is not None else None,
                sampling_params=params[i],
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
                stream=stream,
                rid=(rid if count == 1 else f"{rid}-{i}") if rid else None,
                priority=priority,
                lora_name=adapters[i],
            )
            for i in range(count)
        ]
        if stream:
            if is_batch:
                raise ValueError("stream: streaming takes a single prompt")
            return self._stream(inputs[0])

        async def run_all() -> list[Result | list[Result]]:
            return list(await asyncio.gather(*(self._collect(inp) for inp in inputs)))

        results = self._call(run_all())
        return results if is_batch else results[0]

    def encode(self, prompt: Prompt = None, input_ids: InputIds = None) -> Result | list[Result]:
        """Embeddings from an embedding model (``is_embedding``), as ``sglang.Engine.encode``
        gives them: ``{"embedding": [...], "meta_info": {...}}`` for one prompt, a list
        for a batch (a list of strings, or of token-id lists)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt: give either prompt or input_ids")
        is_batch = isinstance(prompt, list) or (
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        )
        if input_ids is not None:
            inputs = [GenerateInput(input_ids=ids, embed=True) for ids in _id_lists(input_ids, is_batch)]
        else:  # a prompt: is_batch is whether it is a list
            inputs = [
                GenerateInput(text=text, embed=True) for text in (prompt if isinstance(prompt, list) else [prompt])
            ]

        async def run_all() -> list[Result]:
            # An embedding request has a single output: ``_collect`` gives its dict.
            return cast("list[Result]", list(await asyncio.gather(*(self._collect(inp) for inp in inputs))))

        results = [
            {"embedding": out["embedding"], "meta_info": {k: out["meta_info"][k] for k in _ENCODE_META}}
            for out in self._call(run_all())
        ]
        return results if is_batch else results[0]

    async def _collect(self, inp: GenerateInput) -> Result | list[Result]:
        outs = [_as_sglang(out) async for out in self.tokenizer_manager.generate(inp)]
        outs.sort(key=lambda o: o["index"])
        return outs[0] if len(outs) == 1 else outs

    def _stream(self, inp: GenerateInput) -> Iterator[Result]:
        agen = self.tokenizer_manager.generate(inp)
        try:
            while True:
                try:
                    yield _as_sglang(self._call(agen.__anext__()))
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    def run_coroutine(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine's event loop, where ``tokenizer_manager`` lives, and
        return its result: for callers that drive many requests themselves
        (``radixserve bench offline`` streams each one to time its tokens)."""
        return self._call(coro)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if getattr(self, "_closed", False):
            raise RuntimeError("the engine is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._runtime.shutdown()
        self._call(self.tokenizer_manager.close())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """A value given once for all ``count`` prompts, or as a list with one per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name}: {len(value)} given for {count} prompts")
    return value


def _id_lists(input_ids: list[int] | list[list[int]], is_batch: bool) -> list[list[int]]:
    """``input_ids`` as a list of prompts' ids: itself for a batch, else wrapped."""
    # ``is_batch`` holds the check that ``input_ids`` is a list of lists (or a prompt list came).
    return cast("list[list[int]]", input_ids) if is_batch else [cast("list[int]", input_ids)]


def _as_sglang(out: Result) -> Result:
    """A result as ``sglang.Engine`` gives it: ``meta_info["finish_reason"]`` a dict."""
    reason = out["meta_info"]["finish_reason"]
    out["meta_info"]["finish_reason"] = None if reason is None else reason.to_dict()
    return out
