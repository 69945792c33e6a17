"""The reference workloads, defined once here and shared by `bench offline` and `bench serve`.

Prompts are token ids, not text, so every system sees exactly the same input: each prompt
is `numpy.random.default_rng(seed).integers(100, vocab_size - 100, size=prompt_len)`.

| name            | requests | prompt length                                  | output length          |
|-----------------|----------|------------------------------------------------|------------------------|
| `fixed`         | 64       | 128 (seed 0)                                   | 64                     |
| `mixed`         | 64       | uniform 16..512 (seed 0)                       | uniform 16..256 (seed 1) |
| `shared-prefix` | 64       | a 512-token prefix (seed 2) + 32 (seed 3 + i)  | 32                     |
| `serve`         | 200      | as `mixed`                                     | as `mixed`             |
| `multi-turn`    | 16 conversations × 6 turns: each turn's prompt is the conversation so far | 32 |
| `many-prefixes` | 256      | one of 32 system prompts of 1024..2048 (seed 5) + 32 (seed 6) | 32       |
| `grounded`      | 16       | an instruction + a passage of 128..512 tokens of bench/data/jekyll_hyde.txt | 256 |

`multi-turn` (seed 4): each turn adds a user message of uniform 32..256 tokens, and the
prompt of turn t is every earlier user message and assistant answer, then the new user
message. The assistant answers in the history are drawn here, 32 tokens each, not taken
from the server's replies, so every system sees the same prompts; a server that cached
turn t-1's prompt can reuse all of it. A conversation's turns are sent one after another,
each when the previous one has finished; conversations run concurrently.
`many-prefixes` picks each request's system prompt uniformly (seed 6); only the system
prompts are shared, so the hit rate a cache can reach depends on how many prefixes it keeps.
`grounded` (seed 7, text, so it needs the model's tokenizer: `grounded_workload`): each
request asks, through the chat template, to repeat or lightly edit a passage of its own
prompt (whole paragraphs of the Stevenson text, 128..512 tokens), the case speculative
decoding by prompt lookup is for.
"""

from __future__ import annotations

import numpy as np

from pagedserve.common.errors import InvalidParameterError

Workload = tuple[list[list[int]], list[int]]  # (prompts as token ids, output lengths)
#: requests that must run in order, each after the previous finished: (prompt, output length) turns
Conversation = list[tuple[list[int], int]]

#: the workloads `bench offline` runs in-process; `serve` is `bench serve`'s, over HTTP
OFFLINE_WORKLOADS = ("fixed", "mixed", "shared-prefix", "grounded", "structured")  # structured: bench/structured.py
SERVE_WORKLOADS = ("serve", "multi-turn", "many-prefixes")
DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's, the default model


def _ids(rng: np.random.Generator, vocab_size: int, length: int) -> list[int]:
    return rng.integers(100, vocab_size - 100, size=length).tolist()


def fixed_workload(num_requests: int = 64, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Every prompt 128 tokens (one generator, seed 0), every output 64."""
    rng = np.random.default_rng(0)
    return [_ids(rng, vocab_size, 128) for _ in range(num_requests)], [64] * num_requests


def mixed_workload(num_requests: int = 64, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Prompt lengths uniform 16..512 (seed 0), then each prompt's ids from the same
    generator, then output lengths uniform 16..256 (seed 1)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 513, size=num_requests)
    prompts = [_ids(rng, vocab_size, int(n)) for n in lengths]
    outputs = np.random.default_rng(1).integers(16, 257, size=num_requests).tolist()
    return prompts, outputs


def shared_prefix_workload(num_requests: int = 64, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """One common 512-token prefix (seed 2) and a unique 32-token suffix (seed 3 + i); 32 out."""
    prefix = _ids(np.random.default_rng(2), vocab_size, 512)
    prompts = [prefix + _ids(np.random.default_rng(3 + i), vocab_size, 32) for i in range(num_requests)]
    return prompts, [32] * num_requests


def serve_workload(num_requests: int = 200, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """The online `serve` workload: 200 requests drawn as `mixed` draws them."""
    return mixed_workload(num_requests, vocab_size)


def multi_turn_conversations(num_conversations: int = 16, vocab_size: int = DEFAULT_VOCAB_SIZE,
                             turns: int = 6, output_len: int = 32) -> list[Conversation]:
    """`num_conversations` × `turns` (seed 4): each turn's prompt is the conversation so far."""
    rng = np.random.default_rng(4)
    conversations = []
    for _ in range(num_conversations):
        history: list[int] = []
        turns_of_one: Conversation = []
        for _ in range(turns):
            prompt = history + _ids(rng, vocab_size, int(rng.integers(32, 257)))
            turns_of_one.append((prompt, output_len))
            history = prompt + _ids(rng, vocab_size, output_len)  # the answer, as the history records it
        conversations.append(turns_of_one)
    return conversations


def multi_turn_workload(num_conversations: int = 16, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Every turn of `multi_turn_conversations`, conversation by conversation (the order
    `bench serve` keeps within a conversation)."""
    turns = [turn for conversation in multi_turn_conversations(num_conversations, vocab_size) for turn in conversation]
    return [p for p, _ in turns], [n for _, n in turns]


def many_prefixes_workload(num_requests: int = 256, vocab_size: int = DEFAULT_VOCAB_SIZE,
                           num_prefixes: int = 32) -> Workload:
    """`num_prefixes` system prompts of 1024..2048 tokens (seed 5); each request one of them,
    drawn uniformly, + a unique 32-token suffix (seed 6); 32 out."""
    rng = np.random.default_rng(5)
    prefixes = [_ids(rng, vocab_size, int(rng.integers(1024, 2049))) for _ in range(num_prefixes)]
    rng = np.random.default_rng(6)
    prompts = [prefixes[int(rng.integers(num_prefixes))] + _ids(rng, vocab_size, 32) for _ in range(num_requests)]
    return prompts, [32] * num_requests


#: what `grounded` asks of each passage, in turn (the passage follows in triple quotes: with
#: the instruction after the passage, or before it unquoted, the default model follows it less)
GROUNDED_INSTRUCTIONS = (
    "Repeat this text exactly:",
    "Repeat this text exactly, but write \"Mister\" for \"Mr.\":",
    "Copy this text without changing anything:",
    "Repeat this text, with every name in capital letters:",
)


def grounded_workload(tokenizer, num_requests: int = 16, output_len: int = 256) -> Workload:
    """`num_requests` chat prompts (the model's template) that each ask to repeat or lightly
    edit a passage of 128..512 tokens: whole paragraphs of bench/data/jekyll_hyde.txt from a
    paragraph drawn with seed 7, as many as stay under 512 tokens (at least 128)."""
    from pathlib import Path  # noqa: PLC0415 - only this workload reads the text

    text = (Path(__file__).parent / "data" / "jekyll_hyde.txt").read_text(encoding="utf-8")
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) >= 20]
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in paragraphs]
    rng = np.random.default_rng(7)
    prompts: list[list[int]] = []
    while len(prompts) < num_requests:
        start = int(rng.integers(len(paragraphs)))
        end, size = start, 0
        while end < len(paragraphs) and size + lengths[end] <= 512:
            size += lengths[end]
            end += 1
        if size < 128:
            continue  # a lone paragraph too short, or one too long to start with
        instruction = GROUNDED_INSTRUCTIONS[len(prompts) % len(GROUNDED_INSTRUCTIONS)]
        passage = "\n\n".join(paragraphs[start:end])
        messages = [{"role": "user", "content": f'{instruction}\n\n"""\n{passage}\n"""'}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts, [output_len] * num_requests


_BUILDERS = {
    "fixed": (fixed_workload, 64),
    "mixed": (mixed_workload, 64),
    "shared-prefix": (shared_prefix_workload, 64),
    "serve": (serve_workload, 200),
    "multi-turn": (multi_turn_workload, 16),  # the count is of conversations
    "many-prefixes": (many_prefixes_workload, 256),
}


def workload(name: str, vocab_size: int = DEFAULT_VOCAB_SIZE, num_requests: int | None = None) -> Workload:
    """(prompts as token ids, output lengths) of a named workload, exactly as the table above
    defines it; `num_requests` overrides the defined count (for `mixed` and `serve` that
    changes every prompt, since all lengths are drawn before the ids)."""
    if name not in _BUILDERS:
        known = ", ".join([*_BUILDERS, "grounded (grounded_workload: it needs the tokenizer)"])
        raise InvalidParameterError("workload", f"unknown workload {name!r}; known: {known}")
    build, count = _BUILDERS[name]
    return build(count if num_requests is None else num_requests, vocab_size)


def conversations(name: str, vocab_size: int = DEFAULT_VOCAB_SIZE, num_requests: int | None = None) -> list[Conversation]:
    """A workload as the conversations a client sends: `multi-turn`'s turns in order, every
    other workload's requests each a conversation of one turn."""
    if name == "multi-turn":
        return multi_turn_conversations(16 if num_requests is None else num_requests, vocab_size)
    prompts, output_lens = workload(name, vocab_size, num_requests)
    return [[(p, n)] for p, n in zip(prompts, output_lens)]
