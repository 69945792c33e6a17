"""EngineConfig, everything that shapes one worker's engine (from keyword arguments, or flags
and `PAGEDSERVE_*` variables through options.py), and its defaults and choices: the default
model, the step token budget, the KV cache dtypes, the installed quantization methods and
proposers, and how many drafts each proposer makes by default."""

from __future__ import annotations

import msgspec

from pagedserve.common.errors import InvalidParameterError

DEFAULT_MODEL = "smollm2-135m-instruct"

#: A step's token budget when none is given, by device type. On CPU, steps of 2048 prompt
#: tokens ran the `fixed` workload 9-12% faster than one step of 8192 (docs/performance.md);
#: a GPU wants large steps.
DEFAULT_TOKEN_BUDGET = {"cpu": 2048, "cuda": 8192}
#: On CPU the default is also at most this many tokens per torch thread: a step's time grows
#: with its tokens over the threads, and a 2048-token step on one thread took over 10 s
#: (the default worker_timeout) with another process on the core, so the worker looked dead
CPU_TOKENS_PER_THREAD = 1024


#: --int8-kernel choices: auto (timed at load), flags (the CPU's best, untimed), or a kernel's
#: name (whether this CPU can run it is checked at load)
INT8_KERNELS = ("auto", "flags", "avx512vnni", "avxvnni", "avx2", "float")
#: how tensor-parallel ranks on the CPU all-reduce (`tensor_parallel_all_reduce`)
TP_ALL_REDUCES = ("auto", "shm", "gloo")

#: --quantization values besides the methods' names: none (keep the weights), auto (above)
QUANTIZATION_CHOICES = ("none", "auto")
#: what "auto" quantizes a float32 model on CPU to (with its LM head)
CPU_AUTO_QUANTIZATION = "int8"

#: --quantization-calibration choices (which a method implements: its `calibration_methods`)
QUANTIZATION_CALIBRATIONS = ("none", "gptq", "imatrix")

#: --kv-cache-dtype choices (auto: the model's dtype); fp8_e4m3 only on a CUDA device
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


def quantization_methods() -> list[str]:
    """The names in the `pagedserve.quantization` entry-point group (the built-in: int8)."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group="pagedserve.quantization")})


def proposer_methods() -> list[str]:
    """The names in the `pagedserve.proposers` entry-point group (the built-ins: ngram, draft)."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group="pagedserve.proposers")})


#: the most drafts a sequence may verify in one step
MAX_SPECULATIVE_TOKENS = 16
#: drafts per sequence and step when num_speculative_tokens is not given, by method (others:
#: 4). Prompt lookup's cost little to verify at small batches on CPU: 8 against 4 ran `grounded`
#: 4-8% faster at batch 1 and 1% slower at batch 4 (docs/performance-history.md); a draft
#: model's cost one of its forward passes each
METHOD_SPECULATIVE_TOKENS = {"ngram": 8}
DEFAULT_SPECULATIVE_TOKENS = 4


class EngineConfig(msgspec.Struct, kw_only=True):
    """Everything that shapes one worker's engine."""

    model: str = DEFAULT_MODEL  # an alias from `pagedserve models list`, or a checkpoint dir
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bf16 on GPU)
    load_format: str = "auto"  # auto: the checkpoint's safetensors | dummy: seeded random weights (benchmarks)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: from the device
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + KV cache
    max_num_batched_tokens: int | None = None  # token budget of one step; None: DEFAULT_TOKEN_BUDGET
    max_num_seqs: int = 256  # requests running at once
    enable_chunked_prefill: bool = True  # split long prompts across steps under the budget
    max_model_len: int | None = None  # context length; None: the model's own
    enable_prefix_caching: bool = True
    scheduler: str = "fair"  # entry point in pagedserve.schedulers (fair: fcfs within a tenant, shares across tenants)
    sampler: str = "default"  # entry point in pagedserve.samplers
    attention_backend: str = "auto"  # auto (triton on CUDA, cpu on CPU) | torch | cpu | triton
    enforce_eager: bool = False  # every step through the model's forward: no CUDA graphs, no fused CPU decode
    cuda_graph_max_batch: int = 256  # decode batches up to this size (and max_num_seqs) use graphs
    #: CPU float32: decode-only steps of up to this many rows run in the fused C++ step
    #: (kernels/cpu_decode.py; its scratch grows with the largest step run, up to this); 0 turns it off.
    #: 256 (every batch up to the default max_num_seqs; a row's bits then never depend on its
    #: batch): on an AMD EPYC with AVX2 (Zen 3), 2 threads, quiet, the fused step took 226 ms at
    #: batch 32 and 413 at 64 against the eager forward's 371 and 464 (benchmarks/fused_blas.py,
    #: 3 rounds alternated, 2026-11-26). On an AVX-512 EPYC an earlier run (1 thread, loaded) had
    #: it at 496 against 451 ms at batch 64. Packed int8 weights (the CPU default with
    #: --quantization int8) run at every batch as float32 does; unpacked int8 weights stop the
    #: fused step at 16 rows (FUSED_INT8_MAX_BATCH: not measured above that), int4 weights at
    #: the int4 kernel's own limit (int4_kernel_max_rows)
    fused_decode_max_batch: int = 256
    #: in the fused CPU step, float32 products (and the LM head) of this many rows and more call
    #: torch's BLAS instead of our batch-invariant kernels; 0: never. BLAS is faster there but
    #: a row's bits then depend on its batch. Unpacked weights only (pack_cpu_weights off):
    #: packed ones always run the packed product
    fused_decode_blas_rows: int = 0
    #: CPU float32: every linear layer's weight is packed at load into panels of 16 outputs
    #: (kernels/cpu_packed.py) and multiplied by csrc/cpu_packed_gemm.cpp, in prefill and in the
    #: fused decode step alike: batch-invariant at every size, and on an AVX2 EPYC (Zen 3)
    #: 1.2-2.0x the fused step's earlier kernels and 1.8-4.4x torch's F.linear from 1 to 64 rows
    #: (docs/performance.md). No extra memory, except a tied LM head: the fused step packs its
    #: own copy of it (vocab x hidden floats) while the embedding lookup keeps the original;
    #: outside the fused step a tied head's logits still come from torch's F.linear.
    #: int8 linears (--quantization int8) are packed too (PackedInt8Linear: int8 x int8 products,
    #: csrc/cpu_packed_int8.cpp) at every row count, prefill included.
    #: False: torch's BLAS in the eager forward, the earlier kernels in the fused step
    pack_cpu_weights: bool = True
    #: weight quantization at load time: an entry point in pagedserve.quantization (int8:
    #: weight-only int8, one scale per output channel); None or "none": the checkpoint's weights
    #: as they are; "auto" (what `pagedserve serve` and `worker` run when --quantization is not
    #: given): int8 with its LM head for a float32 model on CPU, where int8 beat float32 at
    #: every batch size measured, none elsewhere (model_loader.resolve_quantization)
    quantization: str | None = None
    quantize_lm_head: bool = False  # with `quantization`: the LM head too (the embedding lookup stays float)
    #: with `quantization`: fit the weights to calibration activations at load (the int4 methods;
    #: engine/calibration.py), at the cost of forwards over the calibration tokens (docs/performance.md).
    #: none: data-free; imatrix: each group's scale search weighs each input's error by its Σ x²
    #: over the tokens (llama.cpp's importance matrix, one pass); gptq: GPTQ per linear layer
    #: (plugins/int4_gptq.py, a pass per few layers)
    quantization_calibration: str = "none"
    quantization_calibration_tokens: int = 4096  # the calibration text's first N tokens
    #: a UTF-8 text file to calibrate on; None: engine/data/calibration.txt (not the text of the
    #: perplexity benchmark's figures: engine/data/README.md)
    quantization_calibration_text: str | None = None
    #: CPU, int8 weights: which kernel the int8 linear layers run. auto: each kernel the CPU can
    #: run is timed on the model's own layers at load and the fastest kept
    #: (kernels/int8_kernel_choice.py); flags: the best the CPU's flags allow, untimed; or a
    #: name: avx512vnni | avxvnni | avx2 (int8 × int8 products) | float (weights widened to float32)
    int8_kernel: str = "auto"
    #: the KV cache's element type: auto (the model's dtype) | int8 (per row: head_dim int8
    #: values and a float32 scale; CPU and GPU) | fp8_e4m3 (CUDA only). A quantized cache
    #: holds more tokens in the same --kv-cache-memory; its blocks hash apart from float ones
    kv_cache_dtype: str = "auto"
    max_n: int = 16  # largest n a request may ask for
    #: bytes of the shared KV tier (engine/kv_tier.py): blocks evicted from the pool stay
    #: loadable by every worker of the model; 0: off. Flags and env take sizes like 8GiB
    kv_tier_memory: int = 0
    #: the Redis that holds the tier; None: `serve`'s workers use the queue's Redis
    kv_tier_url: str | None = None
    kv_tier_timeout: float = 2.0  # seconds a new request waits for its tier lookup; past it, it computes
    #: speculative decoding: an entry point in pagedserve.proposers (ngram: prompt lookup;
    #: draft: a smaller model). None: off. Drafts are verified in one step; the output is exactly the target's
    speculative_method: str | None = None
    #: drafts proposed per sequence and step, at most (None: the method's, `speculative_tokens()`)
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int = 4  # ngram: the longest suffix n-gram looked up in the sequence
    prompt_lookup_min: int = 2  # ngram: the shortest
    #: no drafts in a step where more sequences than this run (their verification costs
    #: more than it saves); measured in docs/performance.md, "Speculative decoding"
    speculative_max_batch: int = 4
    #: a sequence whose recent drafts were accepted less than this share pauses proposing
    speculative_min_acceptance: float = 0.25
    speculative_pause_steps: int = 16  # how many steps such a sequence pauses
    #: draft: the draft model (an alias or a checkpoint dir) with the target's tokenizer
    speculative_model: str | None = None
    #: draft: bytes of the draft model's own KV cache (flags and env take sizes like 512MiB)
    speculative_kv_memory: int = 256 * 1024**2
    seed: int = 0  # seeds the sampler of requests that give no seed
    # Structured output (engine/grammar_manager.py): the grammar backend, an entry point in
    # pagedserve.structured_output, and its limits. The gateway applies the same limits
    # before a request is queued
    structured_output_backend: str = "llguidance"
    structured_output_threads: int = 2  # threads that compile grammars and fill token masks
    #: seconds a spec may take to compile; past it the request fails (the gateway: a 400)
    structured_output_compile_timeout: float = 5.0
    #: characters of one spec: a JSON schema's JSON text, a regex, a grammar, or all choices
    max_structured_output_chars: int = 65_536
    #: append the tokens the grammar forces (a key name, `": "`) in the step that reaches
    #: them, instead of one per step; the ids are the same either way
    structured_output_jump_forward: bool = True
    num_threads: int | None = None  # torch CPU threads (per rank); None: torch's default (split over the ranks)
    #: tensor parallelism: ranks (devices) one worker splits the model across; 1: none, no process
    #: is spawned (engine/tensor_parallel.py). On CUDA rank i runs on the i-th GPU from --device's
    tensor_parallel_size: int = 1
    #: seconds a step's collective waits for a rank before the worker goes down (a rank hung or died)
    tensor_parallel_timeout: float = 10.0
    #: seconds the ranks have to start and load their shards
    tensor_parallel_start_timeout: float = 300.0
    #: how CPU ranks sum their partial products: `shm` through a shared-memory region on this
    #: host (engine/shm_all_reduce.py), `gloo` over loopback TCP, `auto` shm where the CPU
    #: kernels build, else gloo. CUDA ranks on GPUs of their own use NCCL whatever this says
    tensor_parallel_all_reduce: str = "auto"

    def speculative_tokens(self) -> int:
        """Drafts per sequence and step, at most: the number given, else the method's default."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return METHOD_SPECULATIVE_TOKENS.get(self.speculative_method or "", DEFAULT_SPECULATIVE_TOKENS)

    def token_budget(self, device_type: str = "cpu", num_threads: int | None = None) -> int:
        """The step token budget: the one given, else the device type's default (on CPU, at
        most CPU_TOKENS_PER_THREAD per thread of `num_threads`, when given)."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        budget = DEFAULT_TOKEN_BUDGET.get(device_type, DEFAULT_TOKEN_BUDGET["cuda"])
        if device_type == "cpu" and num_threads:
            budget = min(budget, CPU_TOKENS_PER_THREAD * num_threads)
        return budget

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidParameterError("block_size", f"must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidParameterError("max_num_batched_tokens", "must be >= 1")
        if self.cuda_graph_max_batch < 1:
            raise InvalidParameterError("cuda_graph_max_batch", "must be >= 1")
        if self.fused_decode_max_batch < 0:
            raise InvalidParameterError("fused_decode_max_batch", "must be >= 0 (0: off)")
        if self.fused_decode_blas_rows < 0:
            raise InvalidParameterError("fused_decode_blas_rows", "must be >= 0 (0: never)")
        if self.max_num_seqs < 1:
            raise InvalidParameterError("max_num_seqs", "must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidParameterError("dtype", f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise InvalidParameterError("load_format", f"must be auto or dummy, got {self.load_format!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise InvalidParameterError("attention_backend", f"must be auto, torch, cpu or triton, got {self.attention_backend!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidParameterError("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise InvalidParameterError("kv_cache_memory", "must be > 0 bytes")
        if self.kv_tier_memory < 0:
            raise InvalidParameterError("kv_tier_memory", "must be >= 0 bytes (0: no tier)")
        if self.kv_tier_timeout <= 0:
            raise InvalidParameterError("kv_tier_timeout", "must be > 0 seconds")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError("kv_cache_dtype", f"must be {', '.join(KV_CACHE_DTYPES)}, "
                                        f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3" and self.device == "cpu":
            raise InvalidParameterError("kv_cache_dtype", "fp8_e4m3 needs a CUDA device; on CPU use int8")
        if self.speculative_method is not None:
            proposers = proposer_methods()
            if self.speculative_method not in proposers:
                raise InvalidParameterError("speculative_method", f"unknown method {self.speculative_method!r}; "
                                            f"choices: {', '.join(proposers) or 'none installed'}")
            if self.speculative_method == "draft" and not self.speculative_model:
                raise InvalidParameterError("speculative_model", "the draft method needs a draft model: "
                                            "speculative={'method': 'draft', 'model': PATH} or --speculative-model")
        if self.speculative_kv_memory <= 0:
            raise InvalidParameterError("speculative_kv_memory", "must be > 0 bytes")
        if not 1 <= self.speculative_tokens() <= MAX_SPECULATIVE_TOKENS:
            raise InvalidParameterError("num_speculative_tokens", f"must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidParameterError("prompt_lookup_min", "must be >= 1 and <= prompt_lookup_max")
        if self.speculative_max_batch < 1:
            raise InvalidParameterError("speculative_max_batch", "must be >= 1")
        if not 0 <= self.speculative_min_acceptance <= 1:
            raise InvalidParameterError("speculative_min_acceptance", "must be in [0, 1]")
        if self.speculative_pause_steps < 1:
            raise InvalidParameterError("speculative_pause_steps", "must be >= 1")
        if self.structured_output_threads < 1:
            raise InvalidParameterError("structured_output_threads", "must be >= 1")
        if self.structured_output_compile_timeout <= 0:
            raise InvalidParameterError("structured_output_compile_timeout", "must be > 0 seconds")
        if self.max_structured_output_chars < 1:
            raise InvalidParameterError("max_structured_output_chars", "must be >= 1")
        if self.tensor_parallel_size < 1:
            raise InvalidParameterError("tensor_parallel_size", "must be >= 1 (1: no tensor parallelism)")
        if self.tensor_parallel_timeout <= 0 or self.tensor_parallel_start_timeout <= 0:
            raise InvalidParameterError("tensor_parallel_timeout", "the tensor-parallel timeouts must be > 0 seconds")
        if self.tensor_parallel_all_reduce not in TP_ALL_REDUCES:
            raise InvalidParameterError("tensor_parallel_all_reduce", f"must be {', '.join(TP_ALL_REDUCES)}, "
                                        f"got {self.tensor_parallel_all_reduce!r}")
        if self.tensor_parallel_size > 1 and self.kv_tier_memory:
            raise InvalidParameterError("kv_tier_memory", "the KV tier holds unsharded blocks: it does not work "
                                        "with tensor_parallel_size > 1 yet")
        if self.int8_kernel not in INT8_KERNELS:
            raise InvalidParameterError("int8_kernel", f"must be {', '.join(INT8_KERNELS)}, got {self.int8_kernel!r}")
        if self.quantization_calibration not in QUANTIZATION_CALIBRATIONS:
            raise InvalidParameterError("quantization_calibration", f"must be {', '.join(QUANTIZATION_CALIBRATIONS)}, "
                                        f"got {self.quantization_calibration!r}")
        if self.quantization_calibration != "none":
            if self.quantization in (None, *QUANTIZATION_CHOICES):
                raise InvalidParameterError("quantization_calibration", "calibrates a quantization method: "
                                            "give --quantization too (e.g. int4)")
            if self.tensor_parallel_size > 1:
                raise InvalidParameterError("quantization_calibration", "does not run with tensor_parallel_size > 1 yet")
            if self.load_format == "dummy":
                raise InvalidParameterError("quantization_calibration", "needs the checkpoint's weights, not dummy ones")
        if self.quantization_calibration_tokens < 1:
            raise InvalidParameterError("quantization_calibration_tokens", "must be >= 1")
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            methods = quantization_methods()
            if self.quantization not in methods:
                raise InvalidParameterError("quantization", f"unknown method {self.quantization!r}; "
                                            f"choices: {', '.join(methods) or 'none installed'}")
