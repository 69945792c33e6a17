"""Plugin contracts and the entry-point loader.

A third-party package adds a scheduler, a sampler or a model architecture by declaring an
entry point in one of these groups, naming a class (or factory) that implements the
matching contract below and sets `API_VERSION`:

    [project.entry-points."pagedserve.samplers"]
    mine = "my_package.sampler:MySampler"
"""

from pagedserve.plugins.base import API_VERSION, CausalLMPlugin, SamplerPlugin, SchedulerPlugin
from pagedserve.plugins.registry import GROUPS, PluginRegistry, load_plugin, registry

__all__ = [
    "API_VERSION",
    "GROUPS",
    "CausalLMPlugin",
    "PluginRegistry",
    "SamplerPlugin",
    "SchedulerPlugin",
    "load_plugin",
    "registry",
]
