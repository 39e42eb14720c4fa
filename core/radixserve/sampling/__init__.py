"""Per-request sampling parameters (the batched sampler is runtime/execution/sampler.py)."""

from radixserve.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
