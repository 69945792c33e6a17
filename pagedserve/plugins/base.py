"""The small contracts each plugin kind implements.

These modules import no torch; tensors appear only in the docstrings' shapes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

#: Bumped when a contract below changes incompatibly; the loader skips plugins that differ.
API_VERSION = 1


class SchedulerPlugin(ABC):
    """Decides, each engine step, which requests compute how many tokens.

    Built by `factory(config: EngineConfig, kv_cache_manager: KVCacheManager)`.
    """

    API_VERSION = API_VERSION

    @abstractmethod
    def add_request(self, request: Any) -> None:
        """Queue a new `worker.request.Request`."""

    @abstractmethod
    def schedule(self) -> Any:
        """Return a `SchedulerOutput`: per request, how many tokens to compute this step."""

    @abstractmethod
    def update(self, scheduler_output: Any, runner_output: Any) -> list[Any]:
        """Apply one step's results; return the requests that got a token or finished."""

    @abstractmethod
    def finish_requests(self, request_ids: list[str], status: Any) -> list[Any]:
        """End these requests now (abort, stop string) and free their blocks."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""


class SamplerPlugin(ABC):
    """Turns a batch of logits into one token per request.

    Built by `factory(config: EngineConfig)`; `sample(logits, metadata)` gets float32
    logits `[num_requests, vocab_size]` and a `worker.sampler.SamplingMetadata`, and returns
    a `worker.sampler.SamplerOutput`.
    """

    API_VERSION = API_VERSION

    @abstractmethod
    def sample(self, logits: Any, metadata: Any) -> Any:
        """Sample one token per row of `logits`."""


class CausalLMPlugin(ABC):
    """A model architecture, keyed by its `architectures` name in config.json.

    Built by `factory(hf_config, dtype, device)`; must be usable as a torch module.
    """

    API_VERSION = API_VERSION

    @abstractmethod
    def forward(self, input_ids: Any, positions: Any, attn_metadata: Any, kv_caches: Any) -> Any:
        """input_ids, positions: [num_tokens] → hidden states [num_tokens, hidden_size].

        Writes each layer's new keys/values into `kv_caches[layer]` at
        `attn_metadata.slot_mapping` and attends over the paged cache.
        """

    @abstractmethod
    def compute_logits(self, hidden_states: Any) -> Any:
        """hidden states [n, hidden_size] → float32 logits [n, vocab_size]."""

    @abstractmethod
    def load_weights(self, weights: Any) -> None:
        """Load from an iterable of (checkpoint tensor name, tensor)."""
