"""Device classes: a worker's speed as rate curves, and its memory.

A step's time is affine in its work, the shape a real worker's step timings fit
(``benchmarks/measure_worker_rates.py`` fits them): a prefill step of n prompt tokens
takes ``prefill_fixed_s + n * prefill_s_per_token``; a decode step of a batch of B
requests holding C tokens of context takes ``decode_fixed_s + B * decode_s_per_request
+ C * decode_s_per_context_token``. So a worker's tokens per second rise with the batch
it runs (the fixed cost is shared), as real workers' do."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceClass:
    name: str
    prefill_fixed_s: float
    prefill_s_per_token: float
    decode_fixed_s: float
    decode_s_per_request: float
    decode_s_per_context_token: float
    kv_tokens: int  # KV capacity: cached blocks plus what running requests hold
    chunk_tokens: int = 2048  # most prompt tokens one prefill step computes
    max_running: int = 64  # most requests in prefill or decode at once

    def prefill_time(self, tokens: int) -> float:
        return self.prefill_fixed_s + tokens * self.prefill_s_per_token

    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        per_batch = batch * self.decode_s_per_request + context_tokens * self.decode_s_per_context_token
        return self.decode_fixed_s + per_batch

    def requests_per_s(self, prompt_tokens: float, answer_tokens: float, batch: int = 32) -> float:
        """A nominal capacity: requests per second with no prompt cached, prompts prefilled
        in full chunks and answers decoded in batches of ``batch``."""
        chunk = self.prefill_time(self.chunk_tokens) / self.chunk_tokens
        step = self.decode_step_time(batch, batch * int(prompt_tokens + answer_tokens / 2)) / batch
        return 1 / (prompt_tokens * chunk + answer_tokens * step)

    def slower(self, factor: float, name: str) -> DeviceClass:
        """The same device ``factor`` times slower at everything (same memory)."""
        return dataclasses.replace(
            self,
            name=name,
            prefill_fixed_s=self.prefill_fixed_s * factor,
            prefill_s_per_token=self.prefill_s_per_token * factor,
            decode_fixed_s=self.decode_fixed_s * factor,
            decode_s_per_request=self.decode_s_per_request * factor,
            decode_s_per_context_token=self.decode_s_per_context_token * factor,
        )


# Measured on this 2-core machine with benchmarks/measure_worker_rates.py (the llama
# benchmark model, float32, cpu backends; docs/benchmarks.md "P15b: the fleet
# simulator" has the points): decode steps fit 13.2 ms + 1.85 ms a request; prefill took
# 1.77-1.88 ms a token at 128-1024 tokens (the fixed cost is lost in the noise). The
# context term is assumed, not measured: 16 ms a step for 32k tokens of context.
MEASURED = DeviceClass(
    name="cpu",
    prefill_fixed_s=0.01,
    prefill_s_per_token=0.0018,
    decode_fixed_s=0.0132,
    decode_s_per_request=0.00185,
    decode_s_per_context_token=0.0000005,
    kv_tokens=32768,
)
HALF = MEASURED.slower(2.0, "cpu/2")
QUARTER = MEASURED.slower(4.0, "cpu/4")
CLASSES = {d.name: d for d in (MEASURED, HALF, QUARTER)}
