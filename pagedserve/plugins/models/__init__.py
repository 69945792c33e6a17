"""Built-in model architectures (registered as `pagedserve.models` entry points)."""
