"""The contracts: the types that cross a boundary inside a worker, and the plugin ABCs.

Everything a scheduler, sampler or model plugin needs is importable from here, and plugins
import nothing else of pagedserve. One engine step hands these from stage to stage:

    Scheduler.schedule()            -> SchedulerOutput   (which sequences, how many tokens)
    ModelRunner.run(SchedulerOutput) -> RunnerOutput     (new tokens per finished prompt: one, or
                                                          the accepted drafts + one)
    Scheduler.update(..)            -> list[SequenceUpdate]   (tokens appended, stops checked)
    OutputProcessor.process(..)     -> list[RequestDelta]     (text and tokens new to the caller)

No module here imports torch at run time: tensors appear in annotations only.
"""

from pagedserve.common.contracts.model import (
    AttentionBackend,
    AttentionMetadata,
    CausalLMPlugin,
    DecoderLayerWeights,
    DecoderWeights,
    KernelOps,
    Kernels,
)
from pagedserve.common.contracts.parallel import (
    ParallelGroup,
    RowSlice,
    even_slice,
    kv_head_slice,
    padded_shard_size,
    tensor_parallel_sizes_problem,
)
from pagedserve.common.contracts.quantization import (
    Calibration,
    LayerInputs,
    QuantizationPlugin,
    QuantizationReport,
)
from pagedserve.common.contracts.request import Request, RequestStatus
from pagedserve.common.contracts.routing import (
    PrefixLookup,
    RouteDecision,
    RouteReason,
    RouterPlugin,
    RoutingInput,
    WorkerCandidate,
)
from pagedserve.common.contracts.runner import (
    ModelInput,
    RunnerOutput,
    SampledLogprobs,
    SequenceUpdate,
)
from pagedserve.common.contracts.sampler import SamplerOutput, SamplerPlugin, SamplingMetadata
from pagedserve.common.contracts.scheduler import (
    KVCacheManager,
    PrefixHit,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerPlugin,
)
from pagedserve.common.contracts.speculative import ProposerPlugin
from pagedserve.common.contracts.structured_output import (
    CompiledGrammar,
    GrammarError,
    GrammarMatcher,
    StructuredOutputBackend,
)
from pagedserve.common.contracts.tool_parser import (
    ParsedOutput,
    ParsedToolCall,
    ToolCallEvent,
    ToolCallStream,
    ToolParser,
)
from pagedserve.common.contracts.version import API_VERSION
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.outputs import CompletionDelta, RequestDelta, RequestOutput
from pagedserve.common.serve_config import ServeConfig
from pagedserve.common.structured_outputs import StructuredOutputsParams

__all__ = [
    "API_VERSION",
    "AttentionBackend",
    "AttentionMetadata",
    "Calibration",
    "CausalLMPlugin",
    "CompiledGrammar",
    "CompletionDelta",
    "DecoderLayerWeights",
    "DecoderWeights",
    "EngineConfig",
    "GrammarError",
    "GrammarMatcher",
    "ServeConfig",
    "KVCacheManager",
    "LayerInputs",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolCallEvent",
    "ToolCallStream",
    "ToolParser",
    "KernelOps",
    "Kernels",
    "ModelInput",
    "ParallelGroup",
    "PrefixHit",
    "PrefixLookup",
    "ProposerPlugin",
    "QuantizationPlugin",
    "QuantizationReport",
    "Request",
    "RequestDelta",
    "RequestOutput",
    "RequestStatus",
    "RouteDecision",
    "RowSlice",
    "RouteReason",
    "RouterPlugin",
    "RoutingInput",
    "RunnerOutput",
    "SampledLogprobs",
    "SamplerOutput",
    "SamplerPlugin",
    "SamplingMetadata",
    "ScheduledRequest",
    "SchedulerOutput",
    "SchedulerPlugin",
    "SequenceUpdate",
    "StructuredOutputBackend",
    "StructuredOutputsParams",
    "WorkerCandidate",
    "even_slice",
    "kv_head_slice",
    "padded_shard_size",
    "tensor_parallel_sizes_problem",
]
