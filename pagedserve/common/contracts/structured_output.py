"""The grammar backend's contract: a `StructuredOutputsParams` in, a matcher per sequence out.

A backend plugin (entry-point group `pagedserve.structured_output`) is built once per
process by `factory(tokenizer_dir: Path, vocab_size: int, eos_token_ids: frozenset[int])`.
The gateway calls `compile` to refuse a bad spec before it is queued; the engine compiles the
same spec again (off the step loop, cached by `StructuredOutputsParams.cache_key`) and gives
each sequence its own `GrammarMatcher`.

Per step, for the rows that sample under a grammar, the engine asks the backend to fill one
preallocated bitmask (`fill_bitmasks`: one bit per vocabulary id, 32 ids per int32 word, set
= allowed) and to apply it to the logits (`apply_bitmask`) before the sampler sees them.

A backend never fails open: a spec it cannot enforce in full raises `GrammarError` naming
what it cannot enforce, and a matcher that errors says so (`error`), after which the engine
ends its request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedserve.common.contracts.version import API_VERSION
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import torch


class GrammarError(InvalidParameterError):
    """The spec is invalid, or asks for something the backend cannot enforce (the message
    names it). `param` is `structured_outputs` unless the caller knows better (the gateway
    names `response_format` or `tools` instead)."""

    def __init__(self, message: str, param: str = "structured_outputs"):
        super().__init__(param, message)
        self.reason = message


class GrammarMatcher(ABC):
    """Where one sequence stands in its grammar. Not thread-safe: one sequence, one matcher."""

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over these tokens, in order. False if the grammar rejects one: the matcher
        is then in error (`error`) and stays so."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected drafts, preemption)."""

    @abstractmethod
    def count_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar accepts from here, without
        advancing (speculative drafts past that count are cut)."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from here, without advancing: the only continuation
        it allows (a key name, `": "`, a closing brace); [] when it allows a choice."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the ids allowed next into `bitmask[row]` (int32 words, bit i of word w = id
        32*w + i). A finished grammar allows only EOS."""

    @property
    @abstractmethod
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more but EOS."""

    @property
    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher failed (a rejected token, a resource limit); None while healthy."""


class CompiledGrammar(ABC):
    """A compiled spec: cheap to hand a new matcher to each sequence."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""


class StructuredOutputBackend(ABC):
    """Compiles specs against one tokenizer, and fills and applies token bitmasks."""

    API_VERSION = API_VERSION

    #: its name in `--structured-output-backend`
    name: str = ""

    @abstractmethod
    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile `spec`, or raise `GrammarError`. May take milliseconds: the engine calls it
        from a thread pool. Must be safe to call from several threads at once."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """A bitmask buffer of `num_rows` rows, allocated once and reused every step."""

    @abstractmethod
    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Fill `bitmask[row]` from each matcher, in parallel where the library allows."""

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """In place: `logits[rows[i]]` keeps the ids allowed by `bitmask[i]`; every other id
        becomes -inf. `logits` is float32 [num_rows, vocab_size] on the model's device."""
