"""Benchmark request sets: ``random``, ``generated-shared-prefix`` and ``jsonl``.

Every set is drawn from one seed, so two engines (or two runs) get identical
requests. Token-id prompts draw from the model's vocabulary minus its special
tokens, so no prompt contains an EOS or a chat marker by chance. ``save_jsonl``
writes a set in the format ``load_jsonl`` reads, which is how other tools (the
vLLM side of ``benchmarks/compare_vllm_cpu.sh``) replay exactly the same requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from transformers import PreTrainedTokenizerBase

from radixserve.bench.args import PROMPT_FORMATS


@dataclass
class BenchRequest:
    """One request: a token-id prompt (``input_ids``) or a text one (``prompt``)."""

    output_len: int
    input_ids: list[int] | None = None
    prompt: str | None = None
    prompt_len: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": self.input_ids} if self.input_ids is not None else {"prompt": self.prompt}
        return {**body, "output_len": self.output_len}


class TokenSource:
    """Draws token ids from a tokenizer's vocabulary, and turns them into text when asked."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_format: str = "ids"):
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format: must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        special = set(tokenizer.all_special_ids)
        self.vocab = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        ids: list[int] = self.vocab[rng.integers(0, len(self.vocab), size=n)].tolist()
        return ids

    def request(self, ids: list[int], output_len: int) -> BenchRequest:
        if self.prompt_format == "ids":
            return BenchRequest(output_len=output_len, input_ids=ids, prompt_len=len(ids))
        text = cast(str, self.tokenizer.decode(ids))  # one sequence's ids decode to one string
        return BenchRequest(
            output_len=output_len, prompt=text, prompt_len=len(self.tokenizer.encode(text, add_special_tokens=False))
        )


def _lengths(rng: np.random.Generator, n: int, full: int, range_ratio: float) -> npt.NDArray[np.int64]:
    """``n`` lengths uniform in [full * range_ratio, full] (at least 1)."""
    if not 0 <= range_ratio <= 1:
        raise ValueError(f"random_range_ratio: must be in [0, 1], got {range_ratio}")
    low = max(1, int(full * range_ratio))
    return rng.integers(low, max(low, full) + 1, size=n)


def random_requests(
    source: TokenSource, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    inputs = _lengths(rng, num_prompts, input_len, range_ratio)
    outputs = _lengths(rng, num_prompts, output_len, range_ratio)
    return [source.request(source.draw(rng, int(i)), int(o)) for i, o in zip(inputs, outputs, strict=True)]


def shared_prefix_requests(
    source: TokenSource,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[BenchRequest]:
    """``num_groups`` system prompts, each followed by ``prompts_per_group`` distinct
    questions; the requests are shuffled so a group's members do not arrive together."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_groups):
        system = source.draw(rng, system_prompt_len)
        requests += [
            source.request(system + source.draw(rng, question_len), output_len) for _ in range(prompts_per_group)
        ]
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def load_jsonl(
    path: str, default_output_len: int, tokenizer: PreTrainedTokenizerBase | None = None
) -> list[BenchRequest]:
    """One JSON object a line: ``{"prompt": str}`` or ``{"input_ids": [int, ...]}``,
    with an optional ``"output_len"`` (else ``default_output_len``)."""
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"dataset_path: {path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("input_ids" in obj):
            raise ValueError(f"{where}: needs exactly one of 'prompt' (text) or 'input_ids' (token ids)")
        output_len = obj.get("output_len", default_output_len)
        if not isinstance(output_len, int) or output_len < 1:
            raise ValueError(f"{where}: output_len must be a positive integer, got {output_len!r}")
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not ids or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"{where}: input_ids must be a non-empty list of integers")
            requests.append(BenchRequest(output_len=output_len, input_ids=ids, prompt_len=len(ids)))
        else:
            text = obj["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError(f"{where}: prompt must be a non-empty string")
            length = len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else 0
            requests.append(BenchRequest(output_len=output_len, prompt=text, prompt_len=length))
    if not requests:
        raise ValueError(f"dataset_path: {path} holds no requests")
    return requests


def save_jsonl(requests: list[BenchRequest], path: str) -> None:
    Path(path).write_text("".join(json.dumps(r.to_json()) + "\n" for r in requests))


def warmup_requests(source: TokenSource, count: int, seed: int) -> list[BenchRequest]:
    """Short requests on their own seed, so warming up leaves nothing in the prefix
    cache that the measured requests could hit."""
    rng = np.random.default_rng([seed, 1])
    return [source.request(source.draw(rng, 16), 8) for _ in range(count)]
