"""`StructuredOutputManager`: the engine's side of structured output, outside the step's math.

    add_request → check (size) → add: compile in a thread pool (cached by the spec's key)
    step start  → poll: a compiled grammar gives each sequence its own matcher (replayed over
                  the tokens a resumed sequence already has) and marks it `grammar_ready`;
                  a compile error or a compile past the timeout fails the request
    sample      → engine/grammar_sampling.py: masks before the sampler, matchers advance after
    after update→ sync: matchers roll back the tokens the scheduler did not append

The backend plugin (group `pagedserve.structured_output`) is built on the first structured
request, so an engine that never sees one pays nothing. Compiled grammars, and the errors of
invalid specs, are cached by `StructuredOutputsParams.cache_key()` (LRU, `CACHE_SIZE`): a spec
seen before, good or bad, costs no compile.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve.common.contracts import (
    CompiledGrammar,
    GrammarError,
    GrammarMatcher,
    Request,
    SchedulerOutput,
    StructuredOutputBackend,
    StructuredOutputsParams,
)
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.plugins import load_plugin


@dataclass(slots=True)
class GrammarState:
    """One sequence's place in its grammar."""

    matcher: GrammarMatcher
    num_tokens: int  # the sequence's token count the matcher has consumed (prompt included)
    jump_forward: bool  # forced tokens are taken without sampling (off for a request that wants logprobs)
    num_extra: int = 0  # tokens the latest step appended beyond one (jump-forward), the last ones


@dataclass(slots=True)
class StructuredOutputCounters:
    """Totals since the engine started (the stats collector reads their changes)."""

    num_requests: int = 0  # structured requests admitted
    num_cache_hits: int = 0  # of their specs, found compiled (or known bad) in the cache
    num_cache_misses: int = 0  # compiled
    num_failed: int = 0  # requests ended by a grammar error, a matcher error or a compile timeout
    num_forced_tokens: int = 0  # tokens a grammar forced (emitted without a sample)
    num_steps_saved: int = 0  # of those, appended beyond one per step by jump-forward
    compile_times: list[float] = field(default_factory=list)  # seconds, new since the stats collector took them


class StructuredOutputManager:
    #: compiled grammars (and invalid specs' errors) kept
    CACHE_SIZE = 512

    def __init__(self, config: EngineConfig, tokenizer_dir: Path, vocab_size: int, eos_token_ids: frozenset[int],
                 device: torch.device):
        self.config = config
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.jump_forward = config.structured_output_jump_forward
        #: bitmask rows: every sampled row of a full batch, verification rows included
        drafts = config.speculative_tokens() if config.speculative_method else 0
        self.max_rows = config.max_num_seqs * (1 + drafts)
        self.counters = StructuredOutputCounters()
        self.states: dict[str, GrammarState] = {}  # sequence id → its matcher (grammar ready)
        self._backend: StructuredOutputBackend | None = None
        self._bitmask: torch.Tensor | None = None
        self._executor: cf.ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, CompiledGrammar | GrammarError] = OrderedDict()
        self._compiling: dict[str, tuple[cf.Future[CompiledGrammar], float]] = {}  # key → (future, started)
        self._waiting: dict[str, tuple[Request, str, float]] = {}  # sequence id → (it, spec key, since)
        self._failed: dict[str, str] = {}  # caller request id → why it fails

    # -- the backend, built once -----------------------------------------------------------
    @property
    def backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            factory = load_plugin("structured_output", self.config.structured_output_backend)
            self._backend = factory(self.tokenizer_dir, self.vocab_size, self.eos_token_ids,
                                    self.config.structured_output_threads)
        return self._backend

    @property
    def bitmask(self) -> torch.Tensor:
        """The one bitmask buffer, allocated on first use and reused by every step."""
        if self._bitmask is None:
            self._bitmask = self.backend.allocate_bitmask(self.max_rows, self.device)
        return self._bitmask

    @property
    def pending(self) -> bool:
        """Sequences wait for their grammar (or failures wait to be reported)."""
        return bool(self._waiting) or bool(self._failed)

    # -- admission ---------------------------------------------------------------------------
    def check(self, spec: StructuredOutputsParams) -> None:
        """Refuse a spec over `max_structured_output_chars` (InvalidParameterError)."""
        limit = self.config.max_structured_output_chars
        if spec.spec_size > limit:
            raise InvalidParameterError("structured_outputs",
                                        f"the spec has {spec.spec_size} characters; the limit is {limit}")

    def add(self, sequences: Sequence[Request], spec: StructuredOutputsParams) -> None:
        """Start compiling `spec` (unless cached) for these sequences of one request; they
        are not `grammar_ready` until `poll` finds it compiled."""
        key = spec.cache_key()
        self.counters.num_requests += 1
        if key in self._cache:
            self._cache.move_to_end(key)
            self.counters.num_cache_hits += 1
        elif key not in self._compiling:
            self.counters.num_cache_misses += 1
            if self._executor is None:
                self._executor = cf.ThreadPoolExecutor(self.config.structured_output_threads,
                                                       thread_name_prefix="grammar-compile")
            self._compiling[key] = (self._executor.submit(self.backend.compile, spec), time.monotonic())
        else:
            self.counters.num_cache_hits += 1  # the same spec compiles already: it waits for that one
        now = time.monotonic()
        for seq in sequences:
            seq.grammar_ready = False
            self._waiting[seq.request_id] = (seq, key, now)

    def poll(self) -> None:
        """Collect finished compiles; make matchers for the sequences whose grammar is ready,
        and fail those whose spec is invalid or whose compile is past the timeout."""
        now = time.monotonic()
        for key, (future, started) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[key]
            exc = future.exception()
            if exc is None:
                self.counters.compile_times.append(now - started)
                self._remember(key, future.result())
            else:
                error = exc if isinstance(exc, GrammarError) else GrammarError(f"the grammar backend failed: {exc}")
                self._remember(key, error)
        timeout = self.config.structured_output_compile_timeout
        for seq_id, (seq, key, since) in list(self._waiting.items()):
            compiled = self._cache.get(key)
            if compiled is None:
                if now - since > timeout:
                    del self._waiting[seq_id]
                    self.fail(seq, f"structured_outputs: the grammar did not compile within {timeout:g} s")
                continue
            del self._waiting[seq_id]
            if isinstance(compiled, GrammarError):
                self.fail(seq, f"{compiled.param}: {compiled.reason}")
                continue
            self._start(seq, compiled)

    def _remember(self, key: str, compiled: CompiledGrammar | GrammarError) -> None:
        self._cache[key] = compiled
        while len(self._cache) > self.CACHE_SIZE:
            self._cache.popitem(last=False)

    def _start(self, seq: Request, compiled: CompiledGrammar) -> None:
        matcher = compiled.matcher()
        sent = seq.output_token_ids  # a resumed sequence: the tokens the client already has
        if sent and not matcher.accept_tokens(sent):
            self.fail(seq, f"structured_outputs: the resumed tokens do not match the grammar: {matcher.error}")
            return
        self.states[seq.request_id] = GrammarState(matcher, seq.num_tokens, seq.sampling_params.logprobs is None)
        seq.grammar_ready = True

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` for a compile (a step with nothing else to run: no busy loop)."""
        futures = [f for f, _ in self._compiling.values()]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    # -- failures ---------------------------------------------------------------------------
    def fail(self, seq: Request, message: str) -> None:
        """End `seq`'s request with `message` (the engine does it after the step: `take_failed`)."""
        parent = seq.parent_id or seq.request_id
        if parent not in self._failed:
            self.counters.num_failed += 1
            self._failed[parent] = message
        self.states.pop(seq.request_id, None)

    def take_failed(self) -> dict[str, str]:
        failed, self._failed = self._failed, {}
        return failed

    def finish(self, sequence_ids: Sequence[str]) -> None:
        """Forget these sequences (ended, aborted or failed)."""
        for seq_id in sequence_ids:
            self.states.pop(seq_id, None)
            self._waiting.pop(seq_id, None)

    # -- after a step --------------------------------------------------------------------------
    def sync(self, scheduled: SchedulerOutput) -> None:
        """Keep each matcher where its sequence is: roll back the tokens the scheduler did not
        append (cut at a stop or max_tokens), forget the sequences that ended."""
        states = self.states
        for entry in scheduled.scheduled:
            request = entry.request
            state = states.get(request.request_id)
            if state is None:
                continue
            cut = state.num_tokens - request.num_tokens
            # the step's last tokens go first: jump-forward saved no step for those cut
            self.counters.num_steps_saved -= min(max(cut, 0), state.num_extra)
            state.num_extra = 0
            if request.is_finished:
                del states[request.request_id]
                continue
            if cut > 0:
                state.matcher.rollback(cut)
                state.num_tokens = request.num_tokens

    def cut_drafts(self, scheduled: SchedulerOutput) -> None:
        """Speculative decoding: cut each structured sequence's drafts at the first one its
        grammar rejects."""
        states = self.states
        for entry in scheduled.scheduled:
            request = entry.request
            state = states.get(request.request_id)
            if state is not None and request.spec_token_ids:
                valid = state.matcher.count_valid(request.spec_token_ids)
                del request.spec_token_ids[valid:]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
