"""`ModelRunner`: the device side of a worker. It sets up the model, the kernels, the KV
cache tensors and the decode fast path (CUDA graphs on GPU, the fused C++ step on CPU) once,
then runs each step:

    run(SchedulerOutput) = prepare_inputs → forward → sample  → RunnerOutput
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import numpy as np
import torch

from pagedserve.common.contracts import (
    AttentionMetadata,
    CausalLMPlugin,
    ModelInput,
    RunnerOutput,
    SamplerPlugin,
    ScheduledRequest,
    SchedulerOutput,
)
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.calibration import CalibrationRequest
from pagedserve.engine.decode_graphs import DecodeGraphs, GraphCaptureError
from pagedserve.engine.device import resolve_device, resolve_dtype
from pagedserve.engine.grammar_manager import StructuredOutputManager
from pagedserve.engine.grammar_sampling import advance, mask_logits
from pagedserve.engine.kv_cache_pool import KVCachePool, resolve_kv_cache_dtype
from pagedserve.engine.model_loader import check_tensor_parallel, load_model, resolve_quantization
from pagedserve.engine.sampling_inputs import SamplingInputs, sampled_logprobs
from pagedserve.engine.speculator import draft_prefixes, verify
from pagedserve.engine.step_inputs import as_rows, kv_spec_for_rank, step_tensors, with_step_budget
from pagedserve.engine.tensor_parallel import ShardRanks, cpu_threads_per_rank
from pagedserve.kernels.cpu_decode import FusedDecoder, fused_decode_supported
from pagedserve.kernels.selector import select_kernels
from pagedserve.plugins import load_plugin

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, hf_config):
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        config = resolve_quantization(config, self.device, self.dtype, hf_config)  # "auto" and "none" decided
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.kernels = select_kernels(config.attention_backend, self.device)  # chosen once, here
        if self.kv_cache_dtype != self.dtype and not self.kernels.attention.quantized_kv:
            if config.attention_backend != "auto":
                raise InvalidParameterError("kv_cache_dtype", f"the {self.kernels.attention.name} attention backend "
                                            f"cannot read an {config.kv_cache_dtype} KV cache; use --attention-backend "
                                            "torch or --kv-cache-dtype auto")
            logger.warning("the %s attention backend cannot read an %s KV cache: every step runs the torch backend",
                           self.kernels.attention.name, config.kv_cache_dtype)
            self.kernels = select_kernels("torch", self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what the kernels' self-check cached is not the KV cache's to lose
        self.attention_backend = self.kernels.attention
        #: tensor parallelism: ranks 1..N-1 and this rank's group (None with N = 1: nothing spawned)
        self.ranks: ShardRanks | None = None
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(hf_config, config.tensor_parallel_size)  # refused before anything starts
            if self.device.type == "cpu":
                torch.set_num_threads(cpu_threads_per_rank(config))
            self.ranks = ShardRanks(config, model_dir, self.device)
        try:
            self._set_up(config, model_dir, hf_config)
        except BaseException:
            self.close()  # no rank outlives a runner that failed to start
            raise

    def _set_up(self, config: EngineConfig, model_dir: Path, hf_config) -> None:
        """The model, the KV cache and the decode fast path (this rank's shards under TP)."""
        parallel = self.ranks.group if self.ranks is not None else None
        self.model = load_model(model_dir, hf_config, self.dtype, self.device, self.kernels, config.load_format,
                                config.quantization, config.quantize_lm_head, parallel, config.int8_kernel,
                                CalibrationRequest.of(config), config.pack_cpu_weights)
        self.vocab_size: int = hf_config.vocab_size
        self.block_size = config.block_size

        spec = kv_spec_for_rank(hf_config, self.kv_cache_dtype, parallel)
        self.num_blocks = KVCachePool.num_blocks_for(
            spec, config.block_size, self.device, config.kv_cache_memory, config.gpu_memory_utilization)
        if self.ranks is not None:
            self.num_blocks = self.ranks.agree_num_blocks(self.num_blocks)  # what fits the fullest rank
        self.kv_pool = KVCachePool(spec, config.block_size, self.num_blocks, self.device)
        self.kv_caches = self.kv_pool.kv_caches
        max_len = min(config.max_model_len or hf_config.max_position_embeddings, hf_config.max_position_embeddings)
        if max_len > self.num_blocks * config.block_size:
            logger.warning("max_model_len %d capped to the KV pool's %d tokens", max_len, self.num_blocks * config.block_size)
            max_len = self.num_blocks * config.block_size
        self.max_model_len: int = max_len
        #: the config with the step token budget resolved for this device and context
        self.config = with_step_budget(config, max_len, self.device.type)
        self.sampler: SamplerPlugin = load_plugin("samplers", config.sampler)(self.config)
        self.sampling_inputs = SamplingInputs(self.vocab_size, self.device)
        #: structured output: the engine's manager (set by the engine); its masks apply to the
        #: logits before the sampler, whatever computed them (eager, fused CPU step, CUDA graph)
        self.grammar: StructuredOutputManager | None = None

        self.decode_graphs: DecodeGraphs | None = None
        self.fused_decoder: FusedDecoder | None = None
        if self.ranks is not None:
            logger.info("decode steps run eagerly: the fused CPU step and CUDA graphs have no all-reduce (TP)")
            return
        if self.device.type == "cuda" and self.attention_backend.name == "triton" and not config.enforce_eager:
            self.enable_decode_graphs(min(config.cuda_graph_max_batch, config.max_num_seqs), max_len)
        # only with the C++ attention backend: one who chose `torch` or `triton` gets those in every step
        if self.attention_backend.name == "cpu" and config.fused_decode_max_batch > 0 and not config.enforce_eager:
            # a speculative step verifies up to speculative_tokens() drafts per sequence, a row each
            query_len = 1 + config.speculative_tokens() if config.speculative_method else 1
            self.enable_fused_decode(min(config.fused_decode_max_batch, config.max_num_seqs * query_len),
                                     config.fused_decode_blas_rows, query_len)

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, cuda_graphs: bool = True) -> None:
        """Run decode-only steps of up to `max_batch` sequences from CUDA graphs (see
        engine/decode_graphs.py; `cuda_graphs=False` runs the same padded path eagerly)."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.attention_backend, self.block_size,
                                          max_batch, max_model_len, self.device, cuda_graphs)

    def enable_fused_decode(self, max_batch: int, blas_rows: int = 0, max_query_len: int = 1) -> None:
        """Run decode-only steps of up to `max_batch` sequences, and the LM head of up to
        `max_batch` rows, in the fused C++ step (kernels/cpu_decode.py), where the model and
        dtype allow it; else log why not and stay eager."""
        weights = cast(CausalLMPlugin, self.model).decoder_weights()
        problem = fused_decode_supported(weights, self.dtype, self.device, self.kv_cache_dtype)
        if problem is not None:
            logger.info("decode steps run eagerly: %s", problem)
            return
        assert weights is not None  # checked above
        self.fused_decoder = FusedDecoder(weights, self.kv_caches, max_batch, blas_rows, max_query_len)
        blas = 0 < blas_rows <= self.fused_decoder.max_batch and not self.fused_decoder.packed
        logger.info("decode steps of up to %d sequences run in the fused CPU step (float32 products: %s)",
                    self.fused_decoder.max_batch, "packed" if self.fused_decoder.packed else
                    f"torch's BLAS from {blas_rows} rows" if blas else "unpacked")

    @torch.inference_mode()
    def run(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        if self.ranks is not None:
            return self._run_ranks(scheduler_output)
        model_input = self.prepare_inputs(scheduler_output.scheduled)
        hidden = self.forward(model_input)
        return self.sample(hidden, model_input, scheduler_output.scheduled)

    def _run_ranks(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """`run` as rank 0 of N (the others: engine/shard_runner.py). Any failure in the step's
        collectives leaves the ranks out of step: RankFailure, naming a rank that died."""
        assert self.ranks is not None
        model_input = self.prepare_inputs(scheduler_output.scheduled)
        self.ranks.send_step(model_input)
        try:
            hidden = self.forward(model_input)
            logits = self.compute_logits(hidden, model_input.sample_rows) if model_input.sample_entries else None
        except Exception as exc:
            raise self.ranks.failure(exc) from exc
        return self.sample(hidden, model_input, scheduler_output.scheduled, logits)

    def close(self) -> None:
        """Stop the other ranks, if any."""
        if self.ranks is not None:
            self.ranks.close()

    def prepare_inputs(self, entries: list[ScheduledRequest]) -> ModelInput:
        """The step's flat batch on the host: one-token queries first, because the attention
        backends batch them, then prefill chunks. An entry that verifies k drafts is k + 1
        one-token rows of its sequence (positions p..p+k, each attending to the context up
        to itself): every backend writes a step's K/V before it attends, so these rows see
        each other's keys exactly as one causal chunk would, and a decode-only step of them
        still runs the decode fast paths."""
        if all(e.num_new_tokens == 1 for e in entries):
            return self._prepare_decodes(entries)
        return self._prepare_mixed(entries)

    def _prepare_mixed(self, entries: list[ScheduledRequest]) -> ModelInput:
        is_rows = [as_rows(e) for e in entries]  # one-token rows
        order = [i for i, rows in enumerate(is_rows) if rows] + [i for i, rows in enumerate(is_rows) if not rows]
        bs = self.block_size
        max_blocks = max(len(e.block_ids) for e in entries)
        tables = np.zeros((len(entries), max_blocks), dtype=np.int32)
        for i, e in enumerate(entries):
            tables[i, : len(e.block_ids)] = e.block_ids
        ids: list[int] = []
        pos_parts, query_lens, seq_lens, table_rows = [], [], [], []
        sample_rows, sample_entries = [], []
        offset = num_decodes = 0
        for i in order:
            entry = entries[i]
            request, n = entry.request, entry.num_new_tokens
            start = request.num_computed_tokens
            end = start + n
            ids.extend(request.token_ids[start:end])
            ids.extend(entry.spec_token_ids)  # past the request's tokens: only drafts
            pos = np.arange(start, end)
            pos_parts.append(pos)
            if is_rows[i]:
                query_lens += [1] * n
                seq_lens += list(range(start + 1, end + 1))
                table_rows += [i] * n
                num_decodes += n
            else:
                query_lens.append(n)
                seq_lens.append(end)
                table_rows.append(i)
            offset += n
            if entry.spec_token_ids:  # every position of a verification is sampled
                sample_rows += list(range(offset - n, offset))
                sample_entries += [i] * n
            elif end == request.num_tokens:  # the prompt is done: this step yields a token
                sample_rows.append(offset - 1)
                sample_entries.append(i)
        positions = np.concatenate(pos_parts)
        entry_of_token = np.repeat(np.array(order), [entries[i].num_new_tokens for i in order])
        slots = tables[entry_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        return ModelInput(ids, positions, slots, query_lens, seq_lens, tables[table_rows], num_decodes,
                          sample_rows, sample_entries)

    def _prepare_decodes(self, entries: list[ScheduledRequest]) -> ModelInput:
        """`prepare_inputs` for a step of one token per sequence, in array operations: the
        common step, and the one whose host work shows at batch 1. The block tables are
        built again every step (a few microseconds a row): a table kept from an earlier step
        would be wrong, silently, for a sequence preempted and readmitted since."""
        n = len(entries)
        computed = [e.request.num_computed_tokens for e in entries]
        ids = [e.request.token_ids[c] for e, c in zip(entries, computed)]
        widths = [len(e.block_ids) for e in entries]
        block_tables = np.zeros((n, max(widths)), dtype=np.int32)
        for row, e in enumerate(entries):
            block_tables[row, : widths[row]] = e.block_ids
        positions = np.array(computed, dtype=np.int64)
        bs = self.block_size
        slots = block_tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = [c + 1 for c in computed]
        # a one-token chunk that does not end its prompt samples nothing
        sample = [i for i, (e, end) in enumerate(zip(entries, seq_lens)) if end == e.request.num_tokens]
        return ModelInput(ids, positions, slots, [1] * n, seq_lens, block_tables, n, sample, sample)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] (from a CUDA graph for a decode-only batch)."""
        graphs = self.decode_graphs
        if graphs is not None and batch.num_decodes == len(batch.query_lens) <= graphs.max_batch:
            try:
                return graphs.run(batch.input_ids, batch.positions, batch.slots, batch.seq_lens, batch.block_tables)
            except GraphCaptureError as exc:  # never let graphs take the worker down: run eagerly
                logger.warning("CUDA graph capture failed (%s); decode steps run eagerly from now on", exc)
                self.decode_graphs = None
        fused = self.fused_decoder
        if fused is not None and fused.takes(batch):
            return fused.forward(batch)
        input_ids, positions, metadata = self._tensors(batch)
        return self.model(input_ids, positions, metadata, self.kv_caches)

    def sample(self, hidden: torch.Tensor, batch: ModelInput, entries: list[ScheduledRequest],
               logits: torch.Tensor | None = None) -> RunnerOutput:
        """The new tokens of each entry whose prompt is complete, and the logprobs asked for
        (from `logits` when given). An entry with drafts keeps those its samples agree with."""
        sampled: list[list[int]] = [[] for _ in entries]
        if not batch.sample_entries:
            return RunnerOutput(sampled, None)
        logits = self.compute_logits(hidden, batch.sample_rows) if logits is None else logits  # [rows, vocab]
        grammar = self.grammar
        step = mask_logits(grammar, logits, entries, batch.sample_entries) if grammar and grammar.states else None
        requests = [entries[i].request for i in batch.sample_entries]
        verifying = any(e.spec_token_ids for e in entries)
        drafts = draft_prefixes(entries, batch.sample_entries) if verifying else None
        result = self.sampler.sample(logits, self.sampling_inputs.for_rows(requests, drafts))
        for i, token in zip(batch.sample_entries, result.sampled_token_ids.tolist()):
            sampled[i].append(token)
        logprobs = sampled_logprobs(result, requests, batch.sample_entries, len(entries))
        if verifying:
            for i, entry in enumerate(entries):
                if entry.spec_token_ids:
                    sampled[i] = verify(entry.spec_token_ids, sampled[i])
                    entry_logprobs = logprobs[i] if logprobs is not None else None
                    if logprobs is not None and entry_logprobs is not None:
                        logprobs[i] = entry_logprobs[: len(sampled[i])]
        if step is not None:
            assert grammar is not None  # a step is made only with one
            return RunnerOutput(sampled, logprobs, advance(grammar, step, entries, sampled, logprobs))
        return RunnerOutput(sampled, logprobs)

    def compute_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """float32 logits of these rows of the hidden states; a few rows go through the fused
        step's LM head, which reads the vocabulary's weights about twice as fast on CPU."""
        fused = self.fused_decoder
        if len(rows) == hidden.shape[0]:
            selected = hidden  # every row (rows are distinct and increasing): no gather
        else:
            selected = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        if fused is not None and len(rows) <= fused.max_batch:
            return fused.logits(selected)
        # a model plugin is both a torch module and a CausalLMPlugin (load_model types it as the module)
        return cast(CausalLMPlugin, self.model).compute_logits(selected)

    def _tensors(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return step_tensors(batch, self.device, self.attention_backend, self.block_size)
