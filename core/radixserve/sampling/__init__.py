"""Per-request sampling parameters (the batched sampler is runtime/sampler.py)."""

from radixserve.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
