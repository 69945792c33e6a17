"""A third-party plugin package: a scheduler, a sampler and a model architecture, written
against `pagedserve.common.contracts` alone (it imports nothing else of pagedserve)."""

from pagedserve_example_plugin.model import ReversedLlamaForCausalLM
from pagedserve_example_plugin.sampler import LowestOfTopTwoSampler, OutdatedSampler
from pagedserve_example_plugin.scheduler import ShortestPromptFirstScheduler

__all__ = ["LowestOfTopTwoSampler", "OutdatedSampler", "ReversedLlamaForCausalLM", "ShortestPromptFirstScheduler"]
