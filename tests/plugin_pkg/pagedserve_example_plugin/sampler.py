"""A sampler that always picks the second most likely token: easy to check exactly."""

from pagedserve.common.contracts import API_VERSION, SamplerOutput, SamplerPlugin


class LowestOfTopTwoSampler(SamplerPlugin):
    def __init__(self, config=None):
        pass

    def sample(self, logits, metadata):
        return SamplerOutput(logits.topk(2, dim=-1).indices[:, 1], None, None, None)


class OutdatedSampler(LowestOfTopTwoSampler):
    """Written for an API this pagedserve does not speak: the loader must skip it."""

    API_VERSION = API_VERSION + 100
