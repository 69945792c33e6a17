"""The version of the plugin contracts."""

#: Bumped when a contract changes incompatibly; the loader skips plugins built for another.
#: 2: models are built with the worker's `Kernels`; KV blocks belong to the KV cache manager.
#: 3: speculative decoding: `RunnerOutput` carries a list of tokens per entry,
#:    `ScheduledRequest.spec_token_ids`, proposer plugins; `Request.seed` replaces its generator.
API_VERSION = 3
