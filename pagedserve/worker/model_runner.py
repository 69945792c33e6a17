"""`ModelRunner`: turns a `SchedulerOutput` into one flat batch, runs the model, samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kernels.attention_backend import AttentionBackend, AttentionMetadata
from pagedserve.worker.decode_graphs import DecodeGraphs, GraphCaptureError
from pagedserve.worker.sampler import SamplerOutput, SamplingMetadata
from pagedserve.worker.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampledLogprobs:
    """Log-probabilities around one sampled token (ids, not yet text)."""

    logprob: float  # of the sampled token
    top_token_ids: list[int]  # best first
    top_logprobs: list[float]


@dataclass(slots=True)
class RunnerOutput:
    """Per entry of `SchedulerOutput.scheduled`, in the same order."""

    sampled_token_ids: list[int | None]  # None: the entry's prompt is not fully computed yet
    logprobs: list[SampledLogprobs | None] | None  # None when no request asked for logprobs


@dataclass(slots=True)
class _Layout:
    input_ids: list[int]  # [num_tokens]
    positions: np.ndarray  # [num_tokens] int64
    slots: np.ndarray  # [num_tokens] int64
    query_lens: list[int]  # [num_seqs]
    seq_lens: list[int]  # [num_seqs]: context length after this step
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    num_decodes: int
    sample_rows: list[int]  # token rows whose logits are sampled
    sample_entries: list[int]  # their entries in SchedulerOutput.scheduled


class ModelRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, device: torch.device,
                 sampler, attention_backend: AttentionBackend, vocab_size: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.attention_backend = attention_backend
        self.vocab_size = vocab_size
        self.decode_graphs: DecodeGraphs | None = None

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, cuda_graphs: bool = True) -> None:
        """Run decode-only steps of up to `max_batch` sequences from CUDA graphs (see
        worker/decode_graphs.py; `cuda_graphs=False` runs the same padded path eagerly)."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.attention_backend, self.block_size,
                                          max_batch, max_model_len, self.device, cuda_graphs)

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> RunnerOutput:
        entries = output.scheduled
        # Decodes (one query token) go first: the attention backends batch them.
        order = [i for i, e in enumerate(entries) if e.num_new_tokens == 1]
        order += [i for i, e in enumerate(entries) if e.num_new_tokens != 1]
        layout = self._layout(entries, order)
        graphs = self.decode_graphs
        hidden = None
        if graphs is not None and layout.num_decodes == len(order) <= graphs.max_batch:
            try:
                hidden = graphs.run(layout.input_ids, layout.positions, layout.slots, layout.seq_lens,
                                    layout.block_tables)
            except GraphCaptureError as exc:  # never let graphs take the worker down: run eagerly
                logger.warning("CUDA graph capture failed (%s); decode steps run eagerly from now on", exc)
                self.decode_graphs = None
        if hidden is None:
            input_ids, positions, metadata = self._tensors(layout)
            hidden = self.model(input_ids, positions, metadata, self.kv_caches)  # [num_tokens, hidden]
        sample_entries = layout.sample_entries
        sample_rows = torch.tensor(layout.sample_rows, dtype=torch.long, device=self.device)
        sampled: list[int | None] = [None] * len(entries)
        logprobs: list[SampledLogprobs | None] | None = None
        if sample_entries:
            logits = self.model.compute_logits(hidden[sample_rows])  # [num_sampled, vocab]
            requests = [entries[i].request for i in sample_entries]
            result = self.sampler.sample(logits, self._sampling_metadata(requests))
            for i, token in zip(sample_entries, result.sampled_token_ids.tolist()):
                sampled[i] = token
            logprobs = self._logprobs(result, requests, sample_entries, len(entries))
        return RunnerOutput(sampled, logprobs)

    def _layout(self, entries, order) -> _Layout:
        """The step's flat batch on the host (decodes first, in `order`)."""
        bs = self.block_size
        num_seqs = len(order)
        query_lens = [entries[i].num_new_tokens for i in order]
        max_blocks = max(len(entries[i].request.blocks) for i in order)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        ids: list[int] = []
        pos_parts, slot_parts = [], []
        seq_lens = []
        sample_rows, sample_entries = [], []
        offset = 0
        for row, i in enumerate(order):
            request, n = entries[i].request, entries[i].num_new_tokens
            start = request.num_computed_tokens
            end = start + n
            table = [b.block_id for b in request.blocks]
            block_tables[row, : len(table)] = table
            ids.extend(request.token_ids[start:end])
            pos = np.arange(start, end)
            pos_parts.append(pos)
            slot_parts.append(block_tables[row, pos // bs].astype(np.int64) * bs + pos % bs)
            seq_lens.append(end)
            offset += n
            if end == request.num_tokens:  # the prompt is done: this step yields a token
                sample_rows.append(offset - 1)
                sample_entries.append(i)
        return _Layout(ids, np.concatenate(pos_parts), np.concatenate(slot_parts), query_lens, seq_lens, block_tables,
                       sum(1 for n in query_lens if n == 1), sample_rows, sample_entries)

    def _tensors(self, layout: _Layout):
        """Input ids, positions and attention metadata on the device, for an eager forward."""
        dev = self.device
        query_start = np.zeros(len(layout.query_lens) + 1, dtype=np.int32)
        np.cumsum(layout.query_lens, out=query_start[1:])
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(layout.slots).to(dev),
            query_start_loc=torch.from_numpy(query_start).to(dev),
            seq_lens=torch.tensor(layout.seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(layout.block_tables).to(dev),
            num_decodes=layout.num_decodes,
            max_seq_len=max(layout.seq_lens),
            query_lens_cpu=layout.query_lens,
            seq_lens_cpu=layout.seq_lens,
            backend=self.attention_backend,
        )
        self.attention_backend.prepare(metadata, self.block_size)
        input_ids = torch.tensor(layout.input_ids, dtype=torch.long, device=dev)
        return input_ids, torch.from_numpy(layout.positions).to(dev), metadata

    def _sampling_metadata(self, requests) -> SamplingMetadata:
        params = [r.sampling_params for r in requests]
        dev = self.device

        def column(values, default, dtype=torch.float32):
            if all(v == default for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=dev)

        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        needs_history = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
        needs_prompt = any(p.repetition_penalty != 1.0 for p in params)
        banned = {}
        for row, (r, p) in enumerate(zip(requests, params)):
            if r.num_output_tokens < p.min_tokens:
                stop_ids = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    stop_ids |= r.eos_token_ids
                if stop_ids:
                    banned[row] = sorted(stop_ids)
        wants_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature=column([p.temperature for p in params], 0.0),
            top_k=column(top_k, self.vocab_size, torch.long),
            top_p=column([p.top_p for p in params], 1.0),
            min_p=column([p.min_p for p in params], 0.0),
            generators={row: r.generator for row, r in enumerate(requests) if r.generator is not None},
            repetition_penalty=column([p.repetition_penalty for p in params], 1.0),
            presence_penalty=column([p.presence_penalty for p in params], 0.0),
            frequency_penalty=column([p.frequency_penalty for p in params], 0.0),
            prompt_token_ids=[r.prompt_token_ids for r in requests] if needs_prompt else [[] for _ in requests],
            output_token_ids=[r.output_token_ids for r in requests] if needs_history else [[] for _ in requests],
            banned_token_ids=banned,
            max_num_logprobs=max(wants_logprobs) if wants_logprobs else None,
        )

    @staticmethod
    def _logprobs(result: SamplerOutput, requests, sample_entries, num_entries):
        if result.logprobs is None:
            return None
        out: list[SampledLogprobs | None] = [None] * num_entries
        sampled_lp = result.logprobs.tolist()
        top_ids = result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for row, (i, request) in enumerate(zip(sample_entries, requests)):
            n = request.sampling_params.logprobs
            if n is None:
                continue
            out[i] = SampledLogprobs(
                sampled_lp[row],
                top_ids[row][:n] if top_ids else [],
                top_lp[row][:n] if top_lp else [],
            )
        return out
