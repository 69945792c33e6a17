"""Incremental detokenization: text deltas that never split a character.

Each new token is decoded together with a few tokens before it, and only the text beyond
what those earlier tokens already produced is emitted. While the newest bytes do not yet
form a whole UTF-8 character (the decoder shows U+FFFD), nothing is emitted; the next token
completes it. Joined, the deltas are the text of all tokens decoded together.
"""

from __future__ import annotations

#: prompt tokens decoded before the first output token, for correct leading spaces
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the tokens decoded as context
        self.read_offset = len(self.token_ids)  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (maybe empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]


class StopStringChecker:
    """Finds stop strings in growing text, also when one spans several tokens.

    `visible` holds back the last len(longest stop) - 1 characters while running, because
    they could still turn out to be the start of a stop string.
    """

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1

    def find(self, text: str, num_new_chars: int) -> tuple[int, str] | None:
        """(position, stop string) of the earliest stop string ending in the new characters."""
        best = None
        for s in self.stop:
            start = max(0, len(text) - num_new_chars - len(s) + 1)
            pos = text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        return best
