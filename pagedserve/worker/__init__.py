"""The worker: engine, scheduler, model runner, KV cache, models and layers."""
