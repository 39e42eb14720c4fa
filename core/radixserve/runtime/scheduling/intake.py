"""The scheduler's own check of an incoming request. The TokenizerManager checks
the same things first; the scheduler checks again so that no message, however
malformed, can take it down."""

from __future__ import annotations

from radixserve.checkpoints.embedding import EmbeddingConfig
from radixserve.config import ServerArgs
from radixserve.messages import FinishReason, GenerateRequest
from radixserve.request_limits import request_fit_error, token_ids_error
from radixserve.runtime.execution.request import Req
from radixserve.sampling.params import SamplingParams


class Intake:
    def __init__(
        self,
        args: ServerArgs,
        vocab_size: int,
        context_length: int,
        kv_pool_tokens: int,
        embedding: EmbeddingConfig | None = None,
    ):
        """``embedding``: the model is served for embeddings (then every request must embed)."""
        self.args = args
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.kv_pool_tokens = kv_pool_tokens
        self.embedding = embedding

    def receive(self, msg: GenerateRequest | Req) -> tuple[Req, FinishReason | None]:
        """The request, and a 400 naming what it got wrong if it can never be served."""
        try:
            req = msg if isinstance(msg, Req) else Req.from_message(msg)
            error = self._error(req)
        except Exception as exc:  # malformed fields: refuse this request, keep serving
            req = Req(rid=str(msg.rid), origin_input_ids=[], sampling_params=SamplingParams())
            error = f"{exc}" if isinstance(exc, ValueError) else f"invalid request: {type(exc).__name__}: {exc}"
        return req, None if error is None else FinishReason(type="abort", message=error, status_code=400)

    def _error(self, req: Req) -> str | None:
        ids = req.origin_input_ids
        error = token_ids_error(ids, self.vocab_size)
        if error is not None:
            return error
        req.sampling_params.validate(self.vocab_size, self.args)  # stop strings included
        error = self._embedding_error(req)
        if error is not None:
            return error
        if req.sampling_params.grammar is not None and self.args.grammar_backend == "none":
            return (
                f"{req.sampling_params.grammar.source or 'grammar'}: structured output is off (--grammar-backend none)"
            )
        max_new = req.sampling_params.max_new_tokens
        return request_fit_error(len(ids), max_new, self.context_length, self.kv_pool_tokens, self.args.page_size)

    def _embedding_error(self, req: Req) -> str | None:
        """An embedding model embeds and a generation model generates; an embedding
        request is a bare prefill (it gets its model's pooling)."""
        if self.embedding is None:
            return "model: the model is served for generation; it computes no embeddings" if req.embed else None
        if not req.embed:
            return "model: the model is served for embeddings; it does not generate"
        if req.sampling_params.max_new_tokens != 0 or req.return_logprob or req.sampling_params.grammar is not None:
            return "embed: an embedding request generates nothing (max_new_tokens 0, no logprobs, no grammar)"
        req.pooling = self.embedding.pooling
        return None
