"""A third-party plugin package: a custom sampler and a custom model architecture."""

import torch

from pagedserve.plugins import API_VERSION, SamplerPlugin
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.sampler import SamplerOutput


class LowestOfTopTwoSampler(SamplerPlugin):
    """Always picks the second most likely token: easy to check exactly."""

    API_VERSION = API_VERSION

    def __init__(self, config=None):
        pass

    def sample(self, logits, metadata):
        return SamplerOutput(logits.topk(2, dim=-1).indices[:, 1], None, None, None)


class OutdatedSampler(LowestOfTopTwoSampler):
    """Written for an API this pagedserve does not speak: the loader must skip it."""

    API_VERSION = API_VERSION + 100


class ReversedLlamaForCausalLM(LlamaForCausalLM):
    """A Llama whose logits are negated: greedy picks the least likely token."""

    def compute_logits(self, hidden_states):
        return -super().compute_logits(hidden_states)


__all__ = ["LowestOfTopTwoSampler", "OutdatedSampler", "ReversedLlamaForCausalLM", "torch"]
