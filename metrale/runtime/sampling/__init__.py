"""Token sampling: parameters, the seeded Philox uniform, and the batch sampler."""

from metrale.runtime.sampling.params import MAX_TOP_LOGPROBS, OutputOptions, SamplingParams, random_seed
from metrale.runtime.sampling.philox import philox4x32_10, uniform
from metrale.runtime.sampling.sampler import SampleResult, SampleRow, sample

__all__ = [
    "MAX_TOP_LOGPROBS",
    "OutputOptions",
    "SampleResult",
    "SampleRow",
    "SamplingParams",
    "philox4x32_10",
    "random_seed",
    "sample",
    "uniform",
]
