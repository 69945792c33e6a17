"""The reference workloads, defined once here and shared by `bench offline` and `bench serve`.

Prompts are token ids, not text, so every system sees exactly the same input: each prompt
is `numpy.random.default_rng(seed).integers(100, vocab_size - 100, size=prompt_len)`.

| name            | requests | prompt length                                  | output length          |
|-----------------|----------|------------------------------------------------|------------------------|
| `fixed`         | 64       | 128 (seed 0)                                   | 64                     |
| `mixed`         | 64       | uniform 16..512 (seed 0)                       | uniform 16..256 (seed 1) |
| `shared-prefix` | 64       | a 512-token prefix (seed 2) + 32 (seed 3 + i)  | 32                     |
| `serve`         | 200      | as `mixed`                                     | as `mixed`             |
"""

from __future__ import annotations

import numpy as np

from pagedserve.common.errors import InvalidParameterError

Workload = tuple[list[list[int]], list[int]]  # (prompts as token ids, output lengths)

#: the workloads `bench offline` runs in-process; `serve` is `bench serve`'s, over HTTP
OFFLINE_WORKLOADS = ("fixed", "mixed", "shared-prefix")
SERVE_WORKLOADS = ("serve",)
DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's, the default model


def _ids(rng: np.random.Generator, vocab_size: int, length: int) -> list[int]:
    return rng.integers(100, vocab_size - 100, size=length).tolist()


def fixed_workload(num_requests: int = 64, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Every prompt 128 tokens (one generator, seed 0), every output 64."""
    rng = np.random.default_rng(0)
    return [_ids(rng, vocab_size, 128) for _ in range(num_requests)], [64] * num_requests


def mixed_workload(num_requests: int = 64, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Prompt lengths uniform 16..512 (seed 0), then each prompt's ids from the same
    generator, then output lengths uniform 16..256 (seed 1)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 513, size=num_requests)
    prompts = [_ids(rng, vocab_size, int(n)) for n in lengths]
    outputs = np.random.default_rng(1).integers(16, 257, size=num_requests).tolist()
    return prompts, outputs


def shared_prefix_workload(num_requests: int = 64, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """One common 512-token prefix (seed 2) and a unique 32-token suffix (seed 3 + i); 32 out."""
    prefix = _ids(np.random.default_rng(2), vocab_size, 512)
    prompts = [prefix + _ids(np.random.default_rng(3 + i), vocab_size, 32) for i in range(num_requests)]
    return prompts, [32] * num_requests


def serve_workload(num_requests: int = 200, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """The online `serve` workload: 200 requests drawn as `mixed` draws them."""
    return mixed_workload(num_requests, vocab_size)


_BUILDERS = {
    "fixed": (fixed_workload, 64),
    "mixed": (mixed_workload, 64),
    "shared-prefix": (shared_prefix_workload, 64),
    "serve": (serve_workload, 200),
}


def workload(name: str, vocab_size: int = DEFAULT_VOCAB_SIZE, num_requests: int | None = None) -> Workload:
    """(prompts as token ids, output lengths) of a named workload, exactly as the table above
    defines it; `num_requests` overrides the defined count (for `mixed` and `serve` that
    changes every prompt, since all lengths are drawn before the ids)."""
    if name not in _BUILDERS:
        raise InvalidParameterError("workload", f"unknown workload {name!r}; known: {', '.join(_BUILDERS)}")
    build, count = _BUILDERS[name]
    return build(count if num_requests is None else num_requests, vocab_size)
