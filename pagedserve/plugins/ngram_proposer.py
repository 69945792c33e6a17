"""The built-in `ngram` proposer (prompt lookup): drafts copied from the sequence itself.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, it looks for the sequence's last
n tokens earlier in the sequence (prompt and output); at the most recent earlier match, the
tokens that followed it are the drafts. Text that repeats or edits a passage of its prompt
(quoting, rewriting, code edits, extraction) is where this pays; elsewhere it seldom finds a
match and proposes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedserve.common.contracts import EngineConfig, ProposerPlugin, Request


class NgramProposer(ProposerPlugin):
    def __init__(self, config: EngineConfig):
        self.n_max = config.prompt_lookup_max
        self.n_min = config.prompt_lookup_min

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        return [lookup(r.token_ids, self.n_min, self.n_max, k) if k > 0 else [] for r, k in zip(requests, max_tokens)]


def lookup(token_ids: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (n_max ≥ n ≥ n_min) of `token_ids`; [] when none occurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = tokens.size
    if length < n_min + 1:
        return []
    # candidate ends of a match: earlier positions holding the last token
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    matched = 1  # the suffix length every candidate in `ends` matches so far
    found: dict[int, np.ndarray] = {}
    while ends.size and matched < n_max:
        ends = ends[ends >= matched]  # room for one more token before the match
        keep = tokens[ends - matched] == tokens[length - 1 - matched]
        ends = ends[keep]
        matched += 1
        if matched >= n_min and ends.size:
            found[matched] = ends
    if n_min == 1 and 1 not in found:
        found[1] = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    for n in range(n_max, n_min - 1, -1):
        candidates = found.get(n)
        if candidates is not None and candidates.size:
            start = int(candidates[-1]) + 1  # the most recent match
            return tokens[start : start + k].tolist()
    return []
