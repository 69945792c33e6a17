import os
import subprocess
import sys

from pagedserve.prefix_cache import ExtraKey, ExtraKeyKind, hash_block
from pagedserve.prefix_cache.block_hash import encode_extra_keys

MODEL = ExtraKey(ExtraKeyKind.MODEL_ID, "m")


def first_block_hash(tokens, extra_keys):
    return hash_block(None, tokens, encode_extra_keys(extra_keys))


def test_hashes_are_chained():
    tokens = list(range(32))
    extra = encode_extra_keys([MODEL])
    first = hash_block(None, tokens[:16], extra)
    second = hash_block(first, tokens[16:], extra)
    assert len({first, second, hash_block(None, tokens[16:], extra)}) == 3
    # the second block's hash depends on the first block's tokens
    other_first = hash_block(None, [99] + tokens[1:16], extra)
    assert other_first != first and hash_block(other_first, tokens[16:], extra) != second


def test_hashes_are_stable_across_processes():
    code = (
        "from pagedserve.prefix_cache import ExtraKey, ExtraKeyKind, hash_block;"
        "from pagedserve.prefix_cache.block_hash import encode_extra_keys;"
        "extra = encode_extra_keys([ExtraKey(ExtraKeyKind.TENANT_SALT, 'acme')]);"
        "print(hash_block(hash_block(None, list(range(16)), extra), list(range(16, 32)), extra).hex())"
    )
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip())
    extra = encode_extra_keys([ExtraKey(ExtraKeyKind.TENANT_SALT, "acme")])
    here = hash_block(hash_block(None, list(range(16)), extra), list(range(16, 32)), extra).hex()
    assert outs == {here}
    assert len(here) == 64


def test_salts_and_key_kinds_never_collide():
    tokens = list(range(16))
    a = first_block_hash(tokens, [MODEL, ExtraKey(ExtraKeyKind.TENANT_SALT, "a")])
    b = first_block_hash(tokens, [MODEL, ExtraKey(ExtraKeyKind.TENANT_SALT, "b")])
    none = first_block_hash(tokens, [MODEL])
    assert len({a, b, none}) == 3
    # same string, different meaning: a model id is not a tenant salt
    assert first_block_hash(tokens, [ExtraKey(ExtraKeyKind.MODEL_ID, "x")]) != first_block_hash(tokens, [ExtraKey(ExtraKeyKind.TENANT_SALT, "x")])
    # the order extra keys are given in does not matter
    salt = ExtraKey(ExtraKeyKind.TENANT_SALT, "a")
    assert first_block_hash(tokens, [salt, MODEL]) == a
    # length-prefixed: ("ab", "c") and ("a", "bc") encode differently
    k1 = [ExtraKey(ExtraKeyKind.MODEL_ID, "ab"), ExtraKey(ExtraKeyKind.TENANT_SALT, "c")]
    k2 = [ExtraKey(ExtraKeyKind.MODEL_ID, "a"), ExtraKey(ExtraKeyKind.TENANT_SALT, "bc")]
    assert encode_extra_keys(k1) != encode_extra_keys(k2)


def test_large_token_ids_are_encoded_exactly():
    assert hash_block(None, [2**40], b"") != hash_block(None, [0], b"")
    assert hash_block(None, [1, 2], b"") != hash_block(None, [2, 1], b"")


def test_prompt_block_hashes_match_the_kv_cache_manager():
    """The gateway's hashes of a prompt are the worker's, for every tenant salt."""
    from pagedserve.common.contracts import Request
    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.engine.kv_cache_manager import KVCacheManager
    from pagedserve.prefix_cache.block_hash import prompt_block_hashes

    tokens = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens over
    for salt in (None, "tenant-a"):
        manager = KVCacheManager(num_blocks=8, block_size=16, enable_caching=True, model_id="m")
        request = Request(request_id="r", prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1), eos_token_ids=frozenset(), max_tokens=1,
                          cache_salt=salt)
        expected = manager._ensure_hashes(request, 3)
        assert prompt_block_hashes(tokens, 16, "m", salt) == expected
        assert len(expected) == 3
    assert prompt_block_hashes(tokens, 16, "m", None) != prompt_block_hashes(tokens, 16, "m", "tenant-a")
    assert prompt_block_hashes(tokens, 16, "m", None) != prompt_block_hashes(tokens, 16, "other", None)
    assert prompt_block_hashes(tokens[:15], 16, "m") == []


def test_a_prompts_hashes_are_the_chain_of_its_full_blocks():
    """The gateway's prompt_block_hashes (one byte string, a primed hasher copied per block)
    equals hash_block chained block by block, as a worker's KV cache manager hashes; the
    partial last block has none."""
    import random

    from pagedserve.prefix_cache.block_hash import extra_keys_for, prompt_block_hashes

    rng = random.Random(5)
    for block_size, salt, kv_dtype in ((1, None, ""), (16, "tenant", ""), (32, "t2", "int8")):
        ids = [rng.randrange(2**17) for _ in range(block_size * 7 + (3 if block_size > 1 else 0))]
        extra = extra_keys_for("model", salt, kv_dtype)
        chain, parent = [], None
        for start in range(0, len(ids) - block_size + 1, block_size):
            parent = hash_block(parent, ids[start : start + block_size], extra)
            chain.append(parent)
        assert prompt_block_hashes(ids, block_size, "model", salt, kv_dtype) == chain
