"""POST /v1/embeddings, in OpenAI's shape, on top of the TokenizerManager.

``input`` is a string, a list of strings, a list of token ids or a list of
them; each is one embedding request (a prefill whose final hidden states the
scheduler pools: runtime/execution/pooling.py), run together, so the scheduler batches
them with whatever else is waiting. ``encoding_format`` ``base64`` is the
little-endian float32 bytes of each vector, as OpenAI's; ``dimensions`` keeps
the first that many values and normalises them again (when the model's
embeddings are normalised), where the model is marked as trained for it
(``EmbeddingConfig.dimensions_error``). ``usage`` counts the input tokens.
"""

from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import Any

from fastapi import Request

from radixserve.server.errors import APIError
from radixserve.server.openai_serving import OpenAIServing
from radixserve.server.protocol import EmbeddingRequest
from radixserve.server.response_models import EmbeddingData, EmbeddingResponse, EmbeddingUsage
from radixserve.server.streaming import cancel_on_disconnect, collect, runtime_errors, start_generation
from radixserve.server.tokenizer_manager import GenerateInput

# The runtime names a prompt by its kind; the API has one field for all.
RENAMES = {"text": "input", "input_ids": "input"}


def inputs_of(value: str | list[Any]) -> list[str | list[int]]:
    """``input`` as a list of prompts: strings or lists of token ids."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(item, int) for item in value):
        return [value]
    if not value:
        raise APIError(400, "input: must not be empty", param="input")
    return list(value)


def truncate(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first ``dimensions`` values, L2-normalised again when ``normalize``."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    cut = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in cut)) if normalize else 0.0
    return [x / norm for x in cut] if norm > 0 else cut


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def create_embeddings(serving: OpenAIServing, body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    serving.check_model(body.model)
    config = serving.tm.embedding
    if config is None:
        raise APIError(
            400,
            f"model: {serving.model_name!r} is served for generation; embeddings need an embedding model "
            "(radixserve serve --is-embedding)",
            param="model",
        )
    if body.dimensions is not None:
        error = config.dimensions_error(body.dimensions)
        if error is not None:
            raise APIError(400, error, param="dimensions")
    rid = f"embd-{uuid.uuid4().hex}"
    prompts = inputs_of(body.input)
    inputs = [
        GenerateInput(
            text=prompt if isinstance(prompt, str) else None,
            input_ids=None if isinstance(prompt, str) else prompt,
            embed=True,
            rid=f"{rid}-{i}",
        )
        for i, prompt in enumerate(prompts)
    ]
    results = start_generation(serving.tm, inputs, RENAMES)
    with runtime_errors(RENAMES):
        outs = await cancel_on_disconnect(request, collect(results, RENAMES))
    outs.sort(key=lambda item: item[0])
    data = [
        EmbeddingData(
            index=i,
            embedding=encode(truncate(out["embedding"], body.dimensions, config.normalize), body.encoding_format),
        )
        for i, out in outs
    ]
    tokens = sum(out["meta_info"]["prompt_tokens"] for _, out in outs)
    return EmbeddingResponse(
        data=data, model=serving.model_name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )
