"""Chained SHA-256 hashes of full KV blocks.

hash(block i) = SHA-256(canonical encoding of (hash(block i-1), token ids of block i, extra keys)).

The encoding is length-prefixed and tagged field by field, so no two different inputs
encode to the same bytes: a model id can never pass for a tenant salt, and a token list can
never run into the extra keys. Nothing depends on PYTHONHASHSEED, so hashes agree across
processes and machines (the gateway and the cluster index use the same function).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_VERSION = b"pagedserve-block-v1"
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


class ExtraKeyKind(enum.IntEnum):
    """What an extra key means; its value is the tag byte in the encoding."""

    MODEL_ID = 1
    TENANT_SALT = 2
    KV_DTYPE = 3  # a quantized KV cache's element type (int8, fp8_e4m3): its blocks never pass for float ones


@dataclass(frozen=True, slots=True)
class ExtraKey:
    """One typed input to every block hash beyond the tokens (e.g. the tenant's salt)."""

    kind: ExtraKeyKind
    value: str


def encode_extra_keys(extra_keys: Sequence[ExtraKey]) -> bytes:
    """Canonical bytes of the extra keys, sorted by kind so their order never matters."""
    parts = [struct.pack("<I", len(extra_keys))]
    for key in sorted(extra_keys, key=lambda k: (k.kind, k.value)):
        value = key.value.encode("utf-8")
        parts.append(struct.pack("<BI", int(key.kind), len(value)))
        parts.append(value)
    return b"".join(parts)


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one block given its parent's hash, its token ids and `encode_extra_keys(...)`."""
    tokens = array("Q", token_ids)
    if tokens.itemsize != 8:  # pragma: no cover - every platform we run on has 8-byte Q
        raise AssertionError("array('Q') must hold 8-byte integers")
    if tokens and array("Q", [1]).tobytes()[0] != 1:  # pragma: no cover - big-endian hosts
        tokens.byteswap()
    h = hashlib.sha256(_VERSION)
    if parent_hash is None:
        h.update(_NO_PARENT)
    else:
        h.update(_HAS_PARENT + parent_hash)
    h.update(struct.pack("<I", len(tokens)))
    h.update(tokens.tobytes())
    h.update(extra)
    return h.digest()


def extra_keys_for(model_id: str, cache_salt: str | None, kv_dtype: str = "") -> bytes:
    """The encoded extra keys of every block hash of one model, tenant salt and KV cache
    dtype (`EngineConfig.kv_cache_dtype` when quantized: "int8", "fp8_e4m3"; "" for a cache
    in the model's dtype, whose hashes carry no dtype key)."""
    keys = [ExtraKey(ExtraKeyKind.MODEL_ID, model_id)]
    if cache_salt is not None:
        keys.append(ExtraKey(ExtraKeyKind.TENANT_SALT, cache_salt))
    if kv_dtype:
        keys.append(ExtraKey(ExtraKeyKind.KV_DTYPE, kv_dtype))
    return encode_extra_keys(keys)


def kv_model_key(model: str, quantization: str | None) -> str:
    """The model id extra key of a worker's blocks: the model, and the quantization its linear
    layers got at load, whose keys and values differ from the float weights' ("model#int8";
    the LM head's does not change them)."""
    return f"{model}#{quantization}" if quantization else model


def kv_dtype_key(kv_cache_dtype: str) -> str:
    """The KV dtype extra key of `EngineConfig.kv_cache_dtype`: "" for auto (the model's dtype)."""
    return "" if kv_cache_dtype == "auto" else kv_cache_dtype


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, model_id: str,
                        cache_salt: str | None = None, kv_dtype: str = "") -> list[bytes]:
    """The chained hashes of every full block of a prompt, exactly as a worker's KV cache
    manager computes them (the gateway uses this to ask the index who holds a prompt)."""
    extra = extra_keys_for(model_id, cache_salt, kv_dtype)
    # hash_block's steps, with what every block shares done once: the tokens as one byte
    # string, the version prefix hashed once and copied, the length packed once
    tokens = array("Q", token_ids)
    if tokens and array("Q", [1]).tobytes()[0] != 1:  # pragma: no cover - big-endian hosts
        tokens.byteswap()
    data = tokens.tobytes()
    versioned = hashlib.sha256(_VERSION)
    length = struct.pack("<I", block_size)
    width = 8 * block_size
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = versioned.copy()
        h.update(_NO_PARENT if parent is None else _HAS_PARENT + parent)
        h.update(length)
        h.update(data[8 * start : 8 * start + width])
        h.update(extra)
        parent = h.digest()
        hashes.append(parent)
    return hashes
