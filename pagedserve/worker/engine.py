"""`Engine`: one worker's model, KV cache and step loop, usable in-process.

    outputs = engine.step()   # schedule → run → update, then detokenize and check stops
"""

from __future__ import annotations

import contextlib
import logging
import operator
import platform
import time
from dataclasses import dataclass

import msgspec
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from pagedserve.common.config import EngineConfig
from pagedserve.common.errors import InvalidParameterError, check_context
from pagedserve.common.model_store import resolve_model
from pagedserve.common.outputs import (
    CompletionOutput,
    Logprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.kernels.attention_backend import get_attention_backend
from pagedserve.plugins import load_plugin
from pagedserve.worker.detokenizer import IncrementalDetokenizer, StopStringChecker
from pagedserve.worker.kv_cache_manager import KVCacheManager
from pagedserve.worker.kv_cache_pool import KVCachePool, KVCacheSpec
from pagedserve.worker.model_loader import load_model
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class _Completion:
    """Output-side state of one sequence."""

    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    stop: StopStringChecker
    num_emitted_chars: int = 0  # of output.text, already handed out as deltas


@dataclass(slots=True)
class _UserRequest:
    """A caller's request and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    sequence_ids: list[str]
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None


@dataclass(slots=True)
class ResumedCompletion:
    """What a client already has of one completion, when its request moves to another worker.

    The engine continues from these tokens (recomputing their KV) instead of starting over,
    so the client sees neither a repeated nor a missing token, sampled or greedy.
    """

    token_ids: list[int]  # generated tokens already sent
    num_chars: int  # characters of text already sent
    finish_reason: str | None = None  # set when this completion had already ended


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name == "bfloat16" and device.type == "cpu" and not _native_cpu_bf16():
            # measured on an AVX2-only EPYC: a [64x576]x[576x3072] matmul runs 17 GFLOP/s in
            # bfloat16 against 110 in float32
            logger.warning("this CPU has no bfloat16 instructions (avx512_bf16 or AMX): bfloat16 "
                           "matmuls run several times slower than float32 here; consider --dtype float32")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    config_dtype = _DTYPES.get(str(config_dtype).removeprefix("torch."), torch.bfloat16)
    return torch.bfloat16 if config_dtype == torch.float32 else config_dtype


def _native_cpu_bf16() -> bool:
    """False only on an x86 CPU that torch finds without avx512_bf16 and AMX."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True  # not known here: no warning
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def _token_id_list(values, vocab_size: int, param: str) -> list[int]:
    """Token ids as plain ints (numpy integers welcome); a typed error if any is not a token."""
    try:
        ids = [operator.index(t) for t in values if not isinstance(t, bool)]
    except TypeError:
        ids = []
    if len(ids) != len(values) or not all(0 <= t < vocab_size for t in ids):
        raise InvalidParameterError(param, f"token ids must be integers in [0, {vocab_size})")
    return ids


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = config or EngineConfig(**overrides)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model(config.model)
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.hf_config = hf_config
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.model = load_model(self.model_dir, hf_config, self.dtype, self.device, config.load_format)

        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        spec = KVCacheSpec(hf_config.num_hidden_layers, num_kv_heads, head_dim, self.dtype)
        num_blocks = KVCachePool.num_blocks_for(
            spec, config.block_size, self.device, config.kv_cache_memory, config.gpu_memory_utilization
        )
        self.kv_pool = KVCachePool(spec, config.block_size, num_blocks, self.device)
        max_len = min(config.max_model_len or hf_config.max_position_embeddings, hf_config.max_position_embeddings)
        if max_len > num_blocks * config.block_size:
            logger.warning("max_model_len %d capped to the KV pool's %d tokens", max_len, num_blocks * config.block_size)
            max_len = num_blocks * config.block_size
        budget = config.token_budget(self.device.type)
        if not config.enable_chunked_prefill:
            if config.max_num_batched_tokens is None:
                budget = max(budget, max_len)  # a whole prompt must fit one step
            elif max_len > budget:
                raise InvalidParameterError("max_num_batched_tokens",
                                            f"without chunked prefill it must be >= max_model_len ({max_len})")
        self.config = config = msgspec.structs.replace(config, max_num_batched_tokens=budget)
        self.max_model_len = max_len
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, model_id=config.model)
        self.scheduler = load_plugin("schedulers", config.scheduler)(config, self.kv_manager)
        self.sampler = load_plugin("samplers", config.sampler)(config)
        backend = get_attention_backend(config.attention_backend, self.device)
        if backend.name == "triton":  # the whole hot path runs as Triton kernels
            for module in self.model.modules():
                if hasattr(module, "use_triton"):
                    module.use_triton = True
        self.runner = ModelRunner(
            self.model, self.kv_pool.kv_caches, config.block_size, self.device, self.sampler,
            backend, hf_config.vocab_size,
        )
        if self.device.type == "cuda" and backend.name == "triton" and not config.enforce_eager:
            self.runner.enable_decode_graphs(min(config.cuda_graph_max_batch, config.max_num_seqs), max_len)
        self.eos_token_ids = self._eos_token_ids()
        self._requests: dict[str, _UserRequest] = {}
        self._sequence_owner: dict[str, tuple[_UserRequest, int]] = {}

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
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        resume: list[ResumedCompletion] | None = None,
    ) -> None:
        """Queue a request; raises a typed error (and queues nothing) on bad input.

        `resume` (one entry per completion) continues a request another worker began.
        """
        params = params or SamplingParams()
        params.validate(max_n=self.config.max_n)
        if request_id in self._requests:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, _token_id_list(prompt, self.hf_config.vocab_size, "prompt")
        if params.stop_token_ids:
            _token_id_list(params.stop_token_ids, self.hf_config.vocab_size, "stop_token_ids")
        if not token_ids:
            raise InvalidParameterError("prompt", "the prompt is empty")
        check_context(len(token_ids), self.max_model_len)  # max_tokens beyond the context is clamped
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)

        if resume is not None and len(resume) != params.n:
            raise InvalidParameterError("resume", f"needs one entry per completion ({params.n})")
        user = _UserRequest(request_id, text, token_ids, [], [], arrival_time=time.monotonic())
        first: Request | None = None
        for index in range(params.n):
            prior = resume[index] if resume is not None else None
            completion = _Completion(
                CompletionOutput(index=index, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None),
                IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens),
                StopStringChecker(params.stop_strings),
            )
            user.completions.append(completion)
            if prior is not None:
                self._replay(completion, prior)
                if prior.finish_reason is not None:
                    continue  # nothing left to generate for this one
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed((params.seed + index) % 2**64)  # any int: negative or huge
            seq = Request(
                request_id=seq_id, prompt_token_ids=token_ids, sampling_params=params,
                eos_token_ids=self.eos_token_ids, max_tokens=max_tokens, parent_id=request_id,
                index=index, fork_from=first, generator=generator, cache_salt=cache_salt,
            )
            if prior is not None:
                # Resumed siblings differ past the prompt: the prefix cache shares what they can.
                seq.fork_from = None
                seq.token_ids.extend(prior.token_ids)
            first = first or seq
            user.sequence_ids.append(seq_id)
            self._sequence_owner[seq_id] = (user, index)
            self.scheduler.add_request(seq)
        assert user.sequence_ids, "every completion had already ended: nothing to resume"
        self._requests[request_id] = user

    @staticmethod
    def _replay(completion: _Completion, prior: ResumedCompletion) -> None:
        """Bring a completion's text state to where the client is, emitting nothing."""
        out = completion.output
        for token in prior.token_ids:
            out.token_ids.append(token)
            out.text += completion.detokenizer.add(token)
        if prior.finish_reason is not None:
            out.text = out.text[: prior.num_chars]  # a stop string may have cut it
            out.finish_reason = prior.finish_reason
        completion.num_emitted_chars = prior.num_chars

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request at once, wherever it is; its blocks go back to the pool."""
        user = self._requests.get(request_id)
        if user is None:
            return None
        self.scheduler.finish_requests(user.sequence_ids, RequestStatus.FINISHED_ABORTED)
        for c in user.completions:
            if c.output.finish_reason is None:
                c.output.finish_reason = "abort"
        return self._emit(user)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns an output for every request that changed."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        try:
            runner_output = self.runner.run(scheduler_output)
        except Exception as exc:  # a failed step fails its requests, never the engine loop
            logger.exception("engine step failed; ending the %d requests it served", len(scheduler_output.scheduled))
            return self._fail({e.request.parent_id for e in scheduler_output.scheduled}, f"{type(exc).__name__}: {exc}")
        updates = self.scheduler.update(scheduler_output, runner_output)
        changed: dict[str, _UserRequest] = {}
        stopped: list[str] = []
        for update in updates:
            seq = update.request
            user, index = self._sequence_owner[seq.request_id]
            completion = user.completions[index]
            if self._append_token(completion, seq, update):
                stopped.append(seq.request_id)
            user.num_cached_tokens = max(user.num_cached_tokens, seq.num_cached_tokens)
            if user.first_token_time is None:
                user.first_token_time = seq.first_token_time
            changed[user.request_id] = user
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return [self._emit(user) for user in changed.values()]

    def _fail(self, request_ids: set[str], error: str) -> list[RequestOutput]:
        """End these user requests with an error the caller sees; their blocks are freed."""
        outputs = []
        for request_id in request_ids:
            user = self._requests[request_id]
            self.scheduler.finish_requests(user.sequence_ids, RequestStatus.FINISHED_ABORTED)
            for c in user.completions:
                if c.output.finish_reason is None:
                    c.output.finish_reason = "error"
            outputs.append(msgspec.structs.replace(self._emit(user), error=error))
        return outputs

    def _append_token(self, completion: _Completion, seq: Request, update) -> bool:
        """Record a sequence's new token and text; True when a stop string ended it."""
        out = completion.output
        token = update.new_token_id
        out.token_ids.append(token)
        if out.logprobs is not None and update.logprobs is not None:
            out.logprobs.append(self._to_logprobs(token, update.logprobs))
        delta = completion.detokenizer.add(token)
        hit_stop = False
        if delta:
            out.text += delta
            found = completion.stop.find(out.text, len(delta))
            if found is not None:
                out.text = out.text[: found[0]]
                out.finish_reason, out.stop_reason = "stop", found[1]
                hit_stop = not seq.is_finished
        if out.finish_reason is None and seq.is_finished:
            out.finish_reason = seq.status.finish_reason
            out.stop_reason = seq.stop_reason
        return hit_stop

    def _to_logprobs(self, token: int, lp) -> Logprobs:
        convert = self.tokenizer.decode
        return Logprobs(
            sampled=TokenLogprob(token, lp.logprob, convert([token])),
            top=[TokenLogprob(t, v, convert([t])) for t, v in zip(lp.top_token_ids, lp.top_logprobs)],
        )

    def _emit(self, user: _UserRequest) -> RequestOutput:
        finished = all(c.output.finish_reason is not None for c in user.completions)
        outputs = []
        for c in user.completions:
            out = c.output
            visible = len(out.text) if out.finish_reason is not None else max(c.num_emitted_chars, len(out.text) - c.stop.hold_back)
            out.text_delta = out.text[c.num_emitted_chars : visible]
            c.num_emitted_chars = visible
            # A snapshot: the engine keeps appending to its own copy.
            outputs.append(msgspec.structs.replace(out, token_ids=list(out.token_ids)))
        if finished:
            del self._requests[user.request_id]
            for seq_id in user.sequence_ids:
                self._sequence_owner.pop(seq_id, None)
        metrics = RequestMetrics(user.arrival_time, user.first_token_time, time.monotonic() if finished else None)
        return RequestOutput(user.request_id, user.prompt, user.prompt_token_ids, outputs, finished,
                             user.num_cached_tokens, metrics=metrics)
