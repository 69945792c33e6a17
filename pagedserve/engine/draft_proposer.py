"""The built-in `draft` proposer: a smaller model with the target's tokenizer guesses the
next tokens greedily, from a paged KV cache of its own.

    propose(requests, k)
        sync      each sequence's draft K/V against its tokens now: the longest prefix the
                  draft cache holds that the sequence still has stays (accepted drafts);
                  the rest is rolled back (rejected drafts) and blocks past it are freed
        catch up  forwards over every sequence's tokens the draft has not seen (a whole
                  prompt the first time, in chunks under the step budget; after a step,
                  the target's new tokens) → each sequence's first draft
        extend    k - 1 one-token steps over the sequences still drafting → drafts 2..k

The draft runs in a `ModelRunner` of its own: same device, dtype, kernels, quantization and
decode fast paths as the target (the fused C++ step on CPU, CUDA graphs on GPU), with a KV
pool of `speculative_kv_memory` bytes. Its blocks are this proposer's alone: no prefix
caching. A sequence that needs blocks when none are free takes those of the sequences that
proposed least recently (they catch up again when they next propose), else proposes nothing
this step. Drafts are the draft model's argmax; verification (engine/speculator.py) keeps the
target's output exact whatever they are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from pagedserve.common.contracts import ModelInput, ProposerPlugin, Request
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.model_store import resolve_model
from pagedserve.engine.model_loader import is_prequantized
from pagedserve.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _DraftSequence:
    """What the draft cache holds for one sequence."""

    tokens: list[int] = field(default_factory=list)  # the token ids whose K/V it holds, in order
    #: how many leading `tokens` are the sequence's own (the rest are drafts fed back): a
    #: sequence's tokens never change, so only the ones after these need comparing again
    num_confirmed: int = 0
    blocks: list[int] = field(default_factory=list)  # its block table in the draft pool
    last_used: int = 0  # the propose call that last used it (which to evict first)


@dataclass(slots=True)
class _Feed:
    """Tokens one sequence feeds the draft model in one forward."""

    state: _DraftSequence
    token_ids: list[int]
    start: int  # position of the first
    sample: bool  # the last token's logits give a draft


class DraftProposer(ProposerPlugin):
    def __init__(self, config: EngineConfig):
        if not config.speculative_model:
            raise InvalidParameterError("speculative_model", "the draft method needs a draft model")
        draft_dir = resolve_model(config.speculative_model)
        target_dir = resolve_model(config.model)
        if AutoTokenizer.from_pretrained(draft_dir).get_vocab() != AutoTokenizer.from_pretrained(target_dir).get_vocab():
            raise InvalidParameterError("speculative_model", f"the draft model {config.speculative_model!r} has a "
                                        f"different tokenizer from the target {config.model!r}")
        hf_config = AutoConfig.from_pretrained(draft_dir)
        self.target_vocab_size: int = AutoConfig.from_pretrained(target_dir).vocab_size
        draft_config = msgspec.structs.replace(
            config, model=str(draft_dir), kv_cache_memory=config.speculative_kv_memory, speculative_method=None,
            max_num_seqs=min(config.max_num_seqs, config.speculative_max_batch), enable_prefix_caching=False,
            tensor_parallel_size=1,  # the small draft runs whole on rank 0
            # a GPTQ / AWQ draft loads as its checkpoint is, whatever the target's weights became
            quantization=None if is_prequantized(hf_config) else config.quantization)
        self.runner = ModelRunner(draft_config, draft_dir, hf_config)
        self.block_size = self.runner.block_size
        self.max_model_len = self.runner.max_model_len
        self.budget = self.runner.config.max_num_batched_tokens or 2048
        self._free = list(range(self.runner.num_blocks - 1, -1, -1))
        self._sequences: dict[str, _DraftSequence] = {}
        self._calls = 0
        self.num_forwards = 0  # draft model forwards so far
        self.num_tokens_fed = 0  # tokens they computed (catch-up and drafts)
        self.num_evicted = 0  # sequences whose draft K/V was dropped for another's blocks
        logger.info("draft model %s: %d KV blocks of %d tokens", draft_dir, self.runner.num_blocks, self.block_size)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        self._calls += 1
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, _DraftSequence, int]] = []  # (index, state, drafts wanted)
        taking = {r.request_id for r in requests}
        for i, (request, k) in enumerate(zip(requests, max_tokens)):
            tokens = request.token_ids
            k = min(k, self.max_model_len - len(tokens) + 1)  # the draft sees positions < max_model_len
            if k <= 0:
                continue
            state = self._sequences.setdefault(request.request_id, _DraftSequence())
            state.last_used = self._calls
            self._rollback(state, tokens)
            # the catch-up, then k - 1 drafts fed back: len(tokens) + k - 1 positions
            if not self._reserve(state, len(tokens) + k - 1, taking):
                continue
            active.append((i, state, k))
        if not active:
            return drafts
        # catch up: each sequence's unseen tokens; the last one's logits give draft 1
        feeds = [_Feed(state, requests[i].token_ids[len(state.tokens):], len(state.tokens), True)
                 for i, state, _ in active]
        for i, state, _ in active:  # once fed, its K/V holds every token of the sequence
            state.num_confirmed = requests[i].num_tokens
        firsts = self._run_chunked(feeds)
        for (i, _, _), token in zip(active, firsts):
            drafts[i].append(token)
        # extend: feed each sequence's newest draft while it wants more
        for j in range(1, max(k for _, _, k in active)):
            going = [(i, state) for i, state, k in active if k > j and drafts[i][-1] < self.target_vocab_size]
            if not going:
                break
            nexts = self._forward([_Feed(state, [drafts[i][-1]], len(state.tokens), True) for i, state in going])
            for (i, _), token in zip(going, nexts):
                drafts[i].append(token)
        for i, _, _ in active:  # a token the target cannot have ends the drafts
            cut = next((j for j, t in enumerate(drafts[i]) if t >= self.target_vocab_size), len(drafts[i]))
            del drafts[i][cut:]
        return drafts

    def finish(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            state = self._sequences.pop(request_id, None)
            if state is not None:
                self._free.extend(reversed(state.blocks))

    # -- the draft cache -----------------------------------------------------------------
    def _rollback(self, state: _DraftSequence, tokens: list[int]) -> None:
        """Keep the draft K/V of the longest prefix that `tokens` still has (and never the
        last token: its logits are needed again), and free the blocks past it."""
        held = state.tokens
        limit = min(len(held), len(tokens) - 1)
        keep = min(state.num_confirmed, limit)
        while keep < limit and held[keep] == tokens[keep]:  # at most the drafts fed last time
            keep += 1
        del held[keep:]
        state.num_confirmed = keep
        needed = -(-keep // self.block_size)
        if len(state.blocks) > needed:
            self._free.extend(reversed(state.blocks[needed:]))
            del state.blocks[needed:]

    def _reserve(self, state: _DraftSequence, num_tokens: int, taking: set[str]) -> bool:
        """Blocks for `num_tokens` positions; free ones first, then those of the sequences
        that proposed least recently (not one of `taking`). False: not enough."""
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        while needed > len(self._free):
            idle = [(s.last_used, rid) for rid, s in self._sequences.items() if rid not in taking and s.blocks]
            if not idle:
                return False
            self.finish([min(idle)[1]])
            self.num_evicted += 1
        for _ in range(max(needed, 0)):
            state.blocks.append(self._free.pop())
        return True

    # -- forwards ------------------------------------------------------------------------
    def _run_chunked(self, feeds: list[_Feed]) -> list[int]:
        """Feed every sequence's tokens in forwards of at most the step budget; the draft
        after each sequence's last token."""
        out: dict[int, int] = {}
        pending = list(enumerate(feeds))
        while pending:
            batch: list[tuple[int, _Feed]] = []
            room = self.budget
            rest = []
            for n, feed in pending:
                if room <= 0:
                    rest.append((n, feed))
                    continue
                take = min(room, len(feed.token_ids))
                batch.append((n, _Feed(feed.state, feed.token_ids[:take], feed.start, take == len(feed.token_ids))))
                room -= take
                if take < len(feed.token_ids):
                    rest.append((n, _Feed(feed.state, feed.token_ids[take:], feed.start + take, True)))
            tokens = self._forward([f for _, f in batch])
            sampled = iter(tokens)
            for n, f in batch:
                if f.sample:
                    out[n] = next(sampled)
            pending = rest
        return [out[n] for n in range(len(feeds))]

    def _forward(self, feeds: list[_Feed]) -> list[int]:
        """One forward of the draft model over these feeds (one-token feeds first, as the
        runner lays out a step); the argmax after the last token of each feed that samples.
        The fed tokens join their sequence's draft K/V."""
        order = sorted(range(len(feeds)), key=lambda n: len(feeds[n].token_ids) != 1)
        bs = self.block_size
        width = max(len(feeds[n].state.blocks) for n in order)
        tables = np.zeros((len(order), width), dtype=np.int32)
        ids: list[int] = []
        positions, slots, query_lens, seq_lens, sample_rows = [], [], [], [], []
        for row, n in enumerate(order):
            feed = feeds[n]
            tables[row, : len(feed.state.blocks)] = feed.state.blocks
            pos = np.arange(feed.start, feed.start + len(feed.token_ids))
            positions.append(pos)
            slots.append(tables[row, pos // bs].astype(np.int64) * bs + pos % bs)
            ids += feed.token_ids
            query_lens.append(len(feed.token_ids))
            seq_lens.append(feed.start + len(feed.token_ids))
            if feed.sample:
                sample_rows.append(len(ids) - 1)
            assert len(feed.state.tokens) == feed.start, "a feed continues its sequence's draft K/V"
            feed.state.tokens += feed.token_ids
        num_decodes = sum(1 for q in query_lens if q == 1)
        batch = ModelInput(ids, np.concatenate(positions), np.concatenate(slots), query_lens, seq_lens, tables,
                           num_decodes, sample_rows, sample_rows)
        hidden = self.runner.forward(batch)
        self.num_forwards += 1
        self.num_tokens_fed += len(ids)
        if not sample_rows:
            return []
        tokens = self.runner.compute_logits(hidden, sample_rows).argmax(dim=-1).tolist()
        # back in the feeds' order
        by_feed = dict(zip([n for n in order if feeds[n].sample], tokens))
        return [by_feed[n] for n in range(len(feeds)) if feeds[n].sample]
