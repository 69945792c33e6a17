"""pagedserve: an LLM inference server with a paged KV cache and continuous batching.

`LLM` and `SamplingParams` are the offline entry points. `LLM` pulls in torch, so it is
imported lazily: the gateway imports `pagedserve.common` without ever loading torch.
"""

from pagedserve.common.outputs import CompletionOutput, RequestOutput
from pagedserve.common.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from pagedserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
