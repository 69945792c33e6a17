"""`OutputLog`: the accepted content of a request's chunks, as both sides fold them (the
gateway, what it sends; a worker resuming, through the gateway's `Fold`). Exported by
`queue_protocol` with the messages it folds."""

from __future__ import annotations

from pagedserve.common.outputs import CompletionDelta
from pagedserve.common.queue_protocol import Chunk, CompletionLog, Fold, WireError


class OutputLog:
    """The accepted content of a request's chunks.

    Rules, the same for the gateway (what it sends) and a worker resuming (what it skips):
    a chunk of an attempt older than the newest seen is void; a delta is taken only if it
    starts exactly where its completion stands and that completion has not ended. A delta
    that starts beyond it means chunks were lost (Redis restarted without them): `gap`.
    """

    def __init__(self, n: int):
        self.attempt = 0
        self.completions = [CompletionLog() for _ in range(n)]
        self.done = False
        self.error: WireError | None = None
        self.num_cached_tokens = 0
        self.gap = False  # a delta skipped tokens the stream never held: the output is incomplete

    def apply(self, chunk: Chunk) -> list[CompletionDelta]:
        """Fold one chunk in; returns the deltas that are new to the client."""
        if self.done or chunk.attempt < self.attempt:
            return []
        self.attempt = chunk.attempt
        accepted = []
        for delta in chunk.deltas:
            if not 0 <= delta.index < len(self.completions):
                continue
            log = self.completions[delta.index]
            if log.finish_reason is None and delta.start > len(log.token_ids):
                self.gap = True
            if log.finish_reason is not None or delta.start != len(log.token_ids):
                continue
            log.token_ids.extend(delta.token_ids)
            log.num_chars += len(delta.text)
            log.finish_reason = delta.finish_reason
            accepted.append(delta)
        if chunk.done:
            self.done = True
            self.error = chunk.error
            self.num_cached_tokens = chunk.num_cached_tokens
        return accepted

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    def fold(self) -> Fold:
        return Fold(waiting=True, completions=self.completions, done=self.done)
