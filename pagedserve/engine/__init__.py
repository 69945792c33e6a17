"""The in-process engine: `Engine` (the step loop) and `LLM` (the offline API) with what they
drive: the model runner, the KV cache manager and pool, the input and output processors,
speculative decoding, the decode graphs and the sampling inputs.

It knows nothing of Redis or HTTP: `pagedserve/worker/` is the service around it, and the
layer contract in pyproject.toml keeps the imports pointing that way.
"""
