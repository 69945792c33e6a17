"""`ModelRunner`: turns a `SchedulerOutput` into one flat batch, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kernels.attention_backend import AttentionBackend, AttentionMetadata
from pagedserve.worker.sampler import SamplerOutput, SamplingMetadata
from pagedserve.worker.scheduler import SchedulerOutput


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

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> RunnerOutput:
        entries = output.scheduled
        # Decodes (one query token) go first: the attention backends batch them.
        order = [i for i, e in enumerate(entries) if e.num_new_tokens == 1]
        order += [i for i, e in enumerate(entries) if e.num_new_tokens != 1]
        input_ids, positions, metadata, sample_rows, sample_entries = self._prepare(entries, order)
        hidden = self.model(input_ids, positions, metadata, self.kv_caches)  # [num_tokens, hidden]
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

    def _prepare(self, entries, order):
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
        dev = self.device
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            query_start_loc=torch.from_numpy(query_start).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            num_decodes=sum(1 for n in query_lens if n == 1),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            backend=self.attention_backend,
        )
        self.attention_backend.prepare(metadata, bs)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.concatenate(pos_parts)).to(dev)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return input_ids, positions, metadata, rows, sample_entries

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
