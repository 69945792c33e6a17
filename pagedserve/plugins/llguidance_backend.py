"""The built-in grammar backend, on llguidance (MIT; a Rust core with no Python dependencies).

Why llguidance: against SmolLM2's tokenizer it compiled a 6-field JSON schema in about 1 ms,
it errs on JSON Schema keywords it cannot enforce instead of ignoring them, its matchers roll
back and report the tokens a grammar forces, and it fills the masks of a whole batch in its
own threads with the GIL released. (xgrammar 0.2.8 filled one mask faster, about 2 µs
against 28 µs p50, but compiled slower, 1.6 to 11 ms; both are far below a step.)

JSON is compact and bounded: `, ` between items, `: ` after keys, and no other whitespace, so
a model cannot pad its answer with newlines until `max_tokens`.

torch is imported only where a tensor is touched: the gateway compiles specs with this
backend to refuse bad ones, and has no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from pagedserve.common.contracts import (
    CompiledGrammar,
    GrammarError,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions

#: how JSON is laid out: fixed separators, no free whitespace
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        return self._m.consume_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self._m.get_error()}")

    def count_valid(self, token_ids: Sequence[int]) -> int:
        return self._m.validate_tokens(list(token_ids))

    def forced_tokens(self) -> list[int]:
        return self._m.compute_ff_tokens()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    @property
    def is_finished(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None


class LLGuidanceGrammar(CompiledGrammar):
    __slots__ = ("_template",)

    def __init__(self, template: llguidance.LLMatcher):
        self._template = template  # never advanced: each sequence gets a copy

    def matcher(self) -> GrammarMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend(StructuredOutputBackend):
    name = "llguidance"

    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_token_ids: frozenset[int], num_threads: int = 2):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(str(Path(tokenizer_dir) / "tokenizer.json"), n_vocab=vocab_size,
                                                eos_token=sorted(eos_token_ids) or None)
        self._executor = llguidance.LLExecutor(num_threads)

    @staticmethod
    def grammar_text(spec: StructuredOutputsParams) -> str:
        """The spec as an llguidance grammar (not yet checked)."""
        kind = spec.kind
        try:
            if kind == "json":
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
                if not isinstance(schema, dict):
                    raise GrammarError("a JSON Schema must be a JSON object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in spec.choice or ())
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            # Lark as it is; GBNF (llama.cpp's EBNF, `root ::= ...`) converted to Lark
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar or ""))
        except GrammarError:
            raise
        except (ValueError, TypeError, GbnfToLarkError) as exc:  # not JSON, not a schema object, a bad GBNF
            raise GrammarError(f"invalid {kind}: {exc}") from None

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        grammar = self.grammar_text(spec)
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {spec.kind}: {_first_line(template.get_error())}")
        return LLGuidanceGrammar(template)

    def allocate_bitmask(self, num_rows: int, device: torch.device) -> torch.Tensor:
        import torch

        # filled on the host (the library writes through a pointer); `apply_bitmask` copies
        # the rows it needs to the logits' device
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        if len(rows) == 1:  # no thread hand-off for one row
            matcher, row = rows[0]
            matcher.fill_bitmask(bitmask, row)
            return
        pairs = [(m._m, row) for m, row in rows]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        import torch

        words = bitmask[: len(rows)].to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[1]].bool()
        if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
            logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "rejected by the grammar backend"
