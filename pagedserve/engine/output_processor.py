"""`OutputProcessor`: sampled tokens in, per-request deltas out, each made exactly once.

For every sequence update of a step it appends the token to its completion, detokenizes
incrementally, looks for stop strings in the new text only, and then hands out what is new
since the last delta: tokens, text (holding back what could still become a stop string)
and logprobs. When a request has ended, its final delta carries the whole `RequestOutput`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.common.contracts import Request, SampledLogprobs, SequenceUpdate
from pagedserve.common.outputs import (
    CompletionDelta,
    CompletionOutput,
    Logprobs,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from pagedserve.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from pagedserve.engine.input_processor import NewRequest

#: the finish reasons a completion's delta carries (what a client sees as finish_reason)
_DELTA_FINISH_REASONS = ("stop", "length")


@dataclass(slots=True)
class _Completion:
    """One completion's text state and what of it the caller has been given."""

    index: int
    detokenizer: IncrementalDetokenizer
    stop: StopStringChecker
    token_ids: list[int] = field(default_factory=list)  # every generated token (appended to)
    text: str = ""  # the text so far (a stop string cut off)
    logprobs: list[Logprobs] | None = None  # one per token generated here, when asked
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_sent_tokens: int = 0  # tokens handed out in deltas (or already with the client)
    num_sent_logprobs: int = 0
    num_sent_chars: int = 0
    finish_sent: bool = False


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    sequence_ids: list[str]  # of the completions this worker generates (not those ended before a resume)
    arrival_time: float
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0  # the most of any of its sequences

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


@dataclass(slots=True)
class ProcessedStep:
    """The output processor's result for one step."""

    deltas: list[RequestDelta]  # one per request the step changed
    stopped: list[str]  # sequences a stop string ended: the scheduler must finish them


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._owner: dict[str, tuple[_RequestState, _Completion]] = {}  # sequence id → its completion

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def sequence_ids(self, request_id: str) -> list[str]:
        return self._requests[request_id].sequence_ids

    def add_request(self, new: NewRequest) -> None:
        params = new.params
        state = _RequestState(new.request_id, new.prompt, new.prompt_token_ids, [], [], new.arrival_time)
        for index, seq in enumerate(new.sequences):
            completion = _Completion(index, IncrementalDetokenizer(self.tokenizer, new.prompt_token_ids,
                                                                   params.skip_special_tokens),
                                     StopStringChecker(params.stop_strings),
                                     logprobs=[] if params.logprobs is not None else None)
            if new.resume is not None:
                self._replay(completion, new.resume[index].token_ids, new.resume[index].num_chars,
                             new.resume[index].finish_reason)
            state.completions.append(completion)
            if seq is not None:
                state.sequence_ids.append(seq.request_id)
                self._owner[seq.request_id] = (state, completion)
        self._requests[new.request_id] = state

    def _replay(self, c: _Completion, token_ids: list[int], num_chars: int, finish_reason: str | None) -> None:
        """Bring a completion to where the client is, handing nothing out again."""
        for token in token_ids:
            c.token_ids.append(token)
            c.text += c.detokenizer.add(token)
        if finish_reason is not None:
            c.text = c.text[:num_chars]  # a stop string may have cut it
            c.finish_reason, c.finish_sent = finish_reason, True
        c.num_sent_tokens, c.num_sent_chars = len(token_ids), num_chars

    def process(self, updates: Iterable[SequenceUpdate]) -> ProcessedStep:
        changed: dict[str, _RequestState] = {}
        stopped: list[str] = []
        for update in updates:
            seq = update.request
            state, completion = self._owner[seq.request_id]
            if completion.finish_reason is not None:
                continue  # a stop string ended it at an earlier token of this step
            if self._append(completion, seq, update):
                stopped.append(seq.request_id)
            state.num_cached_tokens = max(state.num_cached_tokens, seq.num_cached_tokens)
            state.num_preemptions = max(state.num_preemptions, seq.num_preemptions)
            if state.first_token_time is None:
                state.first_token_time = seq.first_token_time
            changed[state.request_id] = state
        return ProcessedStep([self._delta(state) for state in changed.values()], stopped)

    def _append(self, c: _Completion, seq: Request, update: SequenceUpdate) -> bool:
        """Record a sequence's new token and text; True when a stop string ended it."""
        token, logprobs = update.new_token_id, update.logprobs
        c.token_ids.append(token)
        if c.logprobs is not None and logprobs is not None:
            c.logprobs.append(self._to_logprobs(token, logprobs))
        new_text = c.detokenizer.add(token)
        hit_stop = False
        if new_text:
            c.text += new_text
            found = c.stop.find(c.text, len(new_text))
            if found is not None:
                c.text = c.text[: found[0]]
                c.finish_reason, c.stop_reason = "stop", found[1]
                hit_stop = not seq.is_finished
        if c.finish_reason is None and update.ends:
            c.finish_reason = seq.status.finish_reason
            c.stop_reason = seq.stop_reason
        return hit_stop

    def _to_logprobs(self, token: int, lp: SampledLogprobs) -> Logprobs:
        convert = self.tokenizer.decode
        return Logprobs(
            sampled=TokenLogprob(token, lp.logprob, convert([token])),
            top=[TokenLogprob(t, v, convert([t])) for t, v in zip(lp.top_token_ids, lp.top_logprobs)],
        )

    def end(self, request_id: str, finish_reason: str, error: str | None = None) -> RequestDelta | None:
        """End a request outside the step (abort, failure): its last delta, or None if unknown."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        for c in state.completions:
            if c.finish_reason is None:
                c.finish_reason = finish_reason
        delta = self._delta(state)
        delta.error = error
        if delta.output is not None:
            delta.output.error = error
        return delta

    def _delta(self, state: _RequestState) -> RequestDelta:
        """What is new in `state` since its last delta; the whole output once it has ended.

        A delta's finish reason is "stop" or "length"; an abort or an engine error ends the
        request instead (`RequestDelta.error`, the final output's finish reasons)."""
        deltas = []
        for c in state.completions:
            ended = c.finish_reason is not None
            visible = len(c.text) if ended else max(c.num_sent_chars, len(c.text) - c.stop.hold_back)
            report_finish = ended and not c.finish_sent and c.finish_reason in _DELTA_FINISH_REASONS
            if c.num_sent_tokens == len(c.token_ids) and visible == c.num_sent_chars and not report_finish:
                c.finish_sent = ended
                continue
            logprobs = None
            if c.logprobs is not None:
                logprobs = c.logprobs[c.num_sent_logprobs :]
                c.num_sent_logprobs = len(c.logprobs)
            deltas.append(CompletionDelta(
                index=c.index, start=c.num_sent_tokens, token_ids=c.token_ids[c.num_sent_tokens :],
                text=c.text[c.num_sent_chars : visible], logprobs=logprobs,
                finish_reason=c.finish_reason if report_finish else None,
                stop_reason=c.stop_reason if report_finish else None,
            ))
            c.num_sent_tokens, c.num_sent_chars, c.finish_sent = len(c.token_ids), visible, ended
        delta = RequestDelta(request_id=state.request_id, deltas=deltas, num_cached_tokens=state.num_cached_tokens)
        if state.finished:
            delta.finished = True
            delta.output = self._final(state)
            del self._requests[state.request_id]
            for seq_id in state.sequence_ids:
                self._owner.pop(seq_id, None)
        return delta

    @staticmethod
    def _final(state: _RequestState) -> RequestOutput:
        """The whole result; the completions' lists are handed over, not copied (they are done)."""
        outputs = [CompletionOutput(index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason, logprobs=c.logprobs) for c in state.completions]
        metrics = RequestMetrics(state.arrival_time, state.first_token_time, time.monotonic(), state.num_preemptions)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, True,
                             state.num_cached_tokens, metrics=metrics)
