"""What a worker tells the cluster about its cached blocks: `KVEventBatch`es of
`BlockStored` and `BlockRemoved` events, msgpack on the wire (no pickle).

A worker's `BlockPool` records an event whenever a hash enters or leaves its hash map (the
blocks a later request can hit), so applying every event of every worker, in order, gives
exactly the union of the workers' hash maps. The worker sends what accumulated at most once
per engine step, as one batch numbered by its own sequence number within an epoch (a new
epoch per worker process). A consumer that misses a batch, sees a new epoch, or hears that
the worker died cannot patch things up from later batches: it forgets the worker's blocks
and waits for a snapshot batch, which lists every hash the worker holds at that sequence
number (see index.py).
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag="stored", frozen=True, array_like=True):
    """A full block's hash entered the worker's cache."""

    block_hash: bytes  # chained hash (block_hash.py): parent, tokens, model id, tenant salt
    parent_hash: bytes | None  # the previous block's hash; None for a prompt's first block
    num_tokens: int  # tokens in the block (the block size)


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True, array_like=True):
    """A hash left the worker's cache (its block was evicted for other data)."""

    block_hash: bytes


KVEvent = BlockStored | BlockRemoved


class KVEventBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's changes since its previous batch, in order."""

    worker_id: str
    epoch: str  # new each time the worker process starts: its pool starts empty
    seq: int  # this batch's number within the epoch; the first batch of an epoch is 0
    sent_at: float  # unix time when sent, for the consumer's lag
    events: list[KVEvent] = []
    #: a snapshot lists every hash the worker holds after `seq` (as BlockStored events) and
    #: replaces what the consumer knew of it
    snapshot: bool = False


class MalformedBatch(ValueError):
    """Bytes that are not a `KVEventBatch`."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    """The batch in `data`; raises `MalformedBatch` for anything else (including negative
    sequence numbers and token counts)."""
    try:
        batch = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedBatch(str(exc)) from exc
    if batch.seq < 0 or not batch.worker_id or not batch.epoch:
        raise MalformedBatch("a batch needs a worker id, an epoch and a sequence number >= 0")
    if any(isinstance(e, BlockStored) and e.num_tokens <= 0 for e in batch.events):
        raise MalformedBatch("a stored block holds at least one token")
    return batch
