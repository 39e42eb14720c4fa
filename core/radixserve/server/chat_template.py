"""Chat messages -> prompt token ids, through the model's own chat template
(transformers' ``apply_chat_template``) or the file given by ``--chat-template``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from radixserve.server.protocol import ChatCompletionRequest, ChatMessage


class ChatTemplate:
    def __init__(self, tokenizer: Any, override_path: str | None = None):
        self.tokenizer = tokenizer
        if override_path is not None:
            self.source: str | None = Path(override_path).read_text()
            self.origin = override_path
        else:
            self.source = getattr(tokenizer, "chat_template", None) or None
            self.origin = "the tokenizer" if self.source else "none"

    @property
    def available(self) -> bool:
        return self.source is not None

    def render(self, req: ChatCompletionRequest) -> str:
        """The prompt text; ValueError (naming the field) when it cannot be built."""
        if self.source is None:
            raise ValueError(
                "messages: this model has no chat template; start the server with "
                "--chat-template FILE, or use /v1/completions"
            )
        messages = [_message_dict(m) for m in req.messages]
        try:
            prompt: str = self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.source,
                tools=[tool.model_dump(exclude_unset=True) for tool in req.tools] if req.tools else None,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                tokenize=False,
                **(req.chat_template_kwargs or {}),
            )
        except TemplateError as exc:  # e.g. the template's raise_exception on role order
            raise ValueError(f"messages: the chat template rejected them: {exc}") from exc
        except TypeError as exc:  # a kwarg clashing with apply_chat_template's own
            raise ValueError(f"chat_template_kwargs: {exc}") from exc
        return prompt

    def encode(self, req: ChatCompletionRequest) -> list[int]:
        # The template writes any BOS itself.
        ids: list[int] = self.tokenizer.encode(self.render(req), add_special_tokens=False)
        return ids


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as templates expect it: text parts joined by newlines (as vLLM does)."""
    d = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        d["content"] = "\n".join(part.text or "" for part in message.content)  # a TextPart always has its text
    elif message.content is None:
        d["content"] = ""
    return d
