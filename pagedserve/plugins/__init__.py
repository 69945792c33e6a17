"""Plugins: the entry-point loader and the built-in scheduler, sampler and models.

A third-party package adds a scheduler, a sampler or a model architecture by declaring an
entry point in one of these groups, naming a class (or factory) that implements the
matching contract of `pagedserve.common.contracts` and sets `API_VERSION`:

    [project.entry-points."pagedserve.samplers"]
    mine = "my_package.sampler:MySampler"

The built-ins here register the same way and, like any plugin, import only the contracts.
"""

from pagedserve.common.contracts import API_VERSION
from pagedserve.plugins.registry import GROUPS, PluginRegistry, load_plugin, registry

__all__ = ["API_VERSION", "GROUPS", "PluginRegistry", "load_plugin", "registry"]
