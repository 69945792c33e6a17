"""The version of the plugin contracts."""

#: Bumped when a contract changes incompatibly; the loader skips plugins built for another.
#: 2: models are built with the worker's `Kernels`; KV blocks belong to the KV cache manager.
API_VERSION = 2
