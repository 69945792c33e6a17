"""`Engine`: one worker's step loop, usable in-process.

    deltas = engine.step()   # schedule → run → update → process outputs (→ propose drafts)

Set-up is each part's own: the `ModelRunner` builds the model, the kernels, the KV cache
tensors, the CUDA graphs and the sampler plugin; the `KVCacheManager` hands out blocks; the
scheduler is a plugin; the `InputProcessor` validates and fans out requests; the
`OutputProcessor` makes each step's deltas.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from pagedserve.common.contracts import RequestStatus, SchedulerOutput
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.model_store import resolve_model
from pagedserve.common.outputs import RequestDelta
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.step_stats import FinishedRequestStats, StepStats
from pagedserve.engine.grammar_manager import StructuredOutputManager
from pagedserve.engine.input_processor import InputProcessor, ResumedCompletion
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.kv_tier import KVTier
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.speculator import Speculator
from pagedserve.engine.stats_collector import StepStatsCollector
from pagedserve.engine.tensor_parallel import RankFailure
from pagedserve.plugins import load_plugin
from pagedserve.prefix_cache.block_hash import kv_dtype_key, kv_model_key

logger = logging.getLogger(__name__)

__all__ = ["Engine", "ResumedCompletion"]


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = config or EngineConfig(**overrides)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model(config.model)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.runner = ModelRunner(config, self.model_dir, self.hf_config)
        self.max_model_len = self.runner.max_model_len
        self.config = config = self.runner.config  # the step budget resolved for the device
        self.kv_manager = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                         model_id=kv_model_key(config.model, config.quantization),
                                         kv_dtype=kv_dtype_key(config.kv_cache_dtype))
        self.scheduler = load_plugin("schedulers", config.scheduler)(config, self.kv_manager)
        self.input_processor = InputProcessor(self.tokenizer, self.hf_config.vocab_size, self.max_model_len,
                                              config.max_n, self._eos_token_ids())
        self.output_processor = OutputProcessor(self.tokenizer)
        #: structured output: compiles grammars off the step loop, one matcher per sequence
        self.structured = StructuredOutputManager(config, self.model_dir, self.hf_config.vocab_size,
                                                  self.input_processor.eos_token_ids, self.runner.device)
        self.runner.grammar = self.structured
        self.speculator: Speculator | None = None  # speculative decoding (config.speculative_method)
        if config.speculative_method is not None:
            proposer = load_plugin("proposers", config.speculative_method)(config)
            self.speculator = Speculator(config, proposer, config.speculative_method)
        self.stats = StepStatsCollector(self.kv_manager.pool.stats, self.structured.counters)
        self.last_step: StepStats | None = None  # what the latest step did (None: it computed nothing, or failed)
        self.kv_tier: KVTier | None = None  # the shared KV tier (kv_tier_memory > 0 and a URL)
        if config.kv_tier_memory and config.enable_prefix_caching:
            self.kv_tier = self._connect_kv_tier(config)

    def _connect_kv_tier(self, config: EngineConfig) -> KVTier:
        from pagedserve.prefix_cache.kv_tier_store import KVLayout, KVTierStore  # noqa: PLC0415 - only with a tier

        if config.kv_tier_url is None:
            raise InvalidParameterError("kv_tier_url", "a KV tier needs a Redis URL (serve gives its own)")
        spec = self.runner.kv_pool.spec
        layout = KVLayout(config.model, str(spec.dtype).removeprefix("torch."), config.block_size, spec.num_layers,
                          spec.num_kv_heads, spec.head_dim)
        store = KVTierStore.connect(config.kv_tier_url, layout, config.kv_tier_memory)
        logger.info("KV tier: %.2f GiB for blocks of %d bytes", config.kv_tier_memory / 2**30, layout.block_bytes)
        return KVTier(store, self.kv_manager, self.runner.kv_caches, config.kv_tier_timeout)

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        sources = [self.hf_config.eos_token_id, self.tokenizer.eos_token_id]
        with contextlib.suppress(OSError):  # no generation_config.json
            sources.append(GenerationConfig.from_pretrained(self.model_dir).eos_token_id)
        for value in sources:
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        return frozenset(ids)

    # -- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        resume: list[ResumedCompletion] | None = None,
        tenant: str | None = None,
    ) -> None:
        """Queue a request; raises a typed error (and queues nothing) on bad input.

        `resume` (one entry per completion) continues a request another worker began;
        `tenant` is whose share of the engine it uses (see the `fair` scheduler).
        """
        if request_id in self.output_processor:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        params = params or SamplingParams()
        spec = params.structured_outputs
        if spec is not None:
            self.structured.check(spec)
        new = self.input_processor.process(request_id, prompt, params, cache_salt, resume, tenant)
        self.output_processor.add_request(new)
        sequences = [seq for seq in new.sequences if seq is not None]
        if spec is not None:
            self.structured.add(sequences, spec)  # compiles while the prompt prefills
        if self.kv_tier is not None and sequences and self.kv_tier.hold(sequences):
            return  # the scheduler gets them once the tier lookup is done (`step`)
        for seq in sequences:
            self.scheduler.add_request(seq)

    def abort_request(self, request_id: str, finish_reason: str = "abort", record: bool = True) -> RequestDelta | None:
        """End a request at once, wherever it is; its blocks go back to the pool. Its unfinished
        completions end with `finish_reason` ("abort", or "error" when it could not run);
        `record` False leaves it out of `pop_finished` (another worker carries it on)."""
        if request_id not in self.output_processor:
            return None
        sequence_ids = self.output_processor.sequence_ids(request_id)
        if self.kv_tier is not None:
            self.kv_tier.drop(set(sequence_ids))
        if self.speculator is not None:
            self.speculator.finish(sequence_ids)
        self.structured.finish(sequence_ids)
        self.scheduler.finish_requests(sequence_ids, RequestStatus.FINISHED_ABORTED)
        delta = self.output_processor.end(request_id, finish_reason)
        if delta is not None and record:
            self.stats.finished(delta)
        return delta

    def close(self) -> None:
        """Finish what the KV tier is still writing, and stop the tensor-parallel ranks."""
        if self.kv_tier is not None:
            self.kv_tier.close()
        self.structured.close()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def pop_finished(self) -> list[FinishedRequestStats]:
        """The requests that ended (finished, aborted or failed) since the last call."""
        return self.stats.pop_finished()

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One engine step; a delta for every request that changed (what it did: `last_step`)."""
        started = time.monotonic()
        self.last_step = None
        tier = self.kv_tier
        structured = self.structured
        if structured.pending:
            structured.poll()  # grammars compiled since: their sequences may sample
        failed = self._end_failed(structured.take_failed()) if structured.pending else []
        if tier is not None:
            tier.ready(self.scheduler.add_request)  # requests whose tier lookup is done, their blocks loaded
        scheduled = self.scheduler.schedule()
        if tier is not None:
            tier.save_evicted()  # blocks this schedule evicted leave before the step overwrites them
        if scheduled.is_empty:
            if tier is not None:
                tier.wait(0.005)  # nothing to run while lookups are out: no busy loop
            if structured.pending:
                structured.wait(0.005)  # nothing to run while grammars compile
            return failed
        try:
            ran = self.runner.run(scheduled)
        except RankFailure:
            raise  # a tensor-parallel rank is gone: the worker goes down as a whole
        except Exception as exc:  # a failed step fails its requests, never the engine loop
            return failed + self._fail(scheduled, exc)
        updates = self.scheduler.update(scheduled, ran)
        if structured.states:
            structured.sync(scheduled)  # matchers drop the tokens the scheduler did not append
        processed = self.output_processor.process(updates)
        self.scheduler.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        verified = (0, 0, 0)
        if self.speculator is not None:  # what the drafts gained, and the next step's drafts
            verified = self.speculator.record(scheduled, ran)
            self.speculator.propose(scheduled, self.scheduler.num_running)
            if structured.states:
                structured.cut_drafts(scheduled)  # no draft the grammar rejects
        deltas = failed + processed.deltas
        if structured.pending:  # a matcher failed this step: its request ends with the error
            deltas += self._end_failed(structured.take_failed())
        self.last_step = self._step_stats(started, scheduled, processed.deltas, verified)
        return deltas

    def kv_cache_usage(self) -> float:
        """The share of KV blocks in use now (0..1); cached blocks no request holds count as free."""
        kv = self.kv_manager
        return 1.0 - kv.num_free_blocks / kv.num_blocks

    def _step_stats(self, started: float, scheduled: SchedulerOutput, deltas: list[RequestDelta],
                    verified: tuple[int, int, int]) -> StepStats:
        return self.stats.step(started, scheduled, deltas, num_running=self.scheduler.num_running,
                               num_waiting=self.scheduler.num_waiting, kv_cache_usage=self.kv_cache_usage(),
                               verified=verified)

    def _fail(self, scheduled: SchedulerOutput, exc: Exception) -> list[RequestDelta]:
        """End the step's requests with an error the caller sees; their blocks are freed."""
        request_ids = {e.request.parent_id for e in scheduled.scheduled if e.request.parent_id is not None}
        logger.exception("engine step failed; ending the %d requests it served", len(request_ids))
        return self._end_failed({request_id: f"{type(exc).__name__}: {exc}" for request_id in request_ids})

    def _end_failed(self, errors: dict[str, str]) -> list[RequestDelta]:
        """End these requests with their error (`RequestDelta.error`); their blocks are freed."""
        deltas = []
        for request_id, error in errors.items():
            if request_id not in self.output_processor:
                continue
            seq_ids = self.output_processor.sequence_ids(request_id)
            if self.speculator is not None:
                self.speculator.finish(seq_ids)
            self.structured.finish(seq_ids)
            if self.kv_tier is not None:
                self.kv_tier.drop(set(seq_ids))
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            delta = self.output_processor.end(request_id, "error", error=error)
            if delta is not None:
                self.stats.finished(delta)
                deltas.append(delta)
        return deltas
