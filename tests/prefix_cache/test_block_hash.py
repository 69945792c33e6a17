import os
import subprocess
import sys

from pagedserve.prefix_cache import ExtraKey, ExtraKeyKind, hash_blocks
from pagedserve.prefix_cache.block_hash import encode_extra_keys, hash_block

MODEL = ExtraKey(ExtraKeyKind.MODEL_ID, "m")


def test_only_full_blocks_are_hashed_and_chained():
    tokens = list(range(37))
    hashes = hash_blocks(tokens, 16, [MODEL])
    assert len(hashes) == 2
    extra = encode_extra_keys([MODEL])
    first = hash_block(None, tokens[:16], extra)
    assert hashes == [first, hash_block(first, tokens[16:32], extra)]
    # the second block's hash depends on the first block's tokens
    other = hash_blocks([99] + tokens[1:], 16, [MODEL])
    assert other[0] != hashes[0] and other[1] != hashes[1]


def test_hashes_are_stable_across_processes():
    code = (
        "from pagedserve.prefix_cache import ExtraKey, ExtraKeyKind, hash_blocks;"
        "print(hash_blocks(list(range(40)), 16, [ExtraKey(ExtraKeyKind.TENANT_SALT, 'acme')])[1].hex())"
    )
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip())
    here = hash_blocks(list(range(40)), 16, [ExtraKey(ExtraKeyKind.TENANT_SALT, "acme")])[1].hex()
    assert outs == {here}
    assert len(here) == 64


def test_salts_and_key_kinds_never_collide():
    tokens = list(range(16))
    a = hash_blocks(tokens, 16, [MODEL, ExtraKey(ExtraKeyKind.TENANT_SALT, "a")])
    b = hash_blocks(tokens, 16, [MODEL, ExtraKey(ExtraKeyKind.TENANT_SALT, "b")])
    none = hash_blocks(tokens, 16, [MODEL])
    assert len({a[0], b[0], none[0]}) == 3
    # same string, different meaning: a model id is not a tenant salt
    assert hash_blocks(tokens, 16, [ExtraKey(ExtraKeyKind.MODEL_ID, "x")]) != hash_blocks(tokens, 16, [ExtraKey(ExtraKeyKind.TENANT_SALT, "x")])
    # the order extra keys are given in does not matter
    salt = ExtraKey(ExtraKeyKind.TENANT_SALT, "a")
    assert hash_blocks(tokens, 16, [salt, MODEL]) == a
    # length-prefixed: ("ab", "c") and ("a", "bc") encode differently
    k1 = [ExtraKey(ExtraKeyKind.MODEL_ID, "ab"), ExtraKey(ExtraKeyKind.TENANT_SALT, "c")]
    k2 = [ExtraKey(ExtraKeyKind.MODEL_ID, "a"), ExtraKey(ExtraKeyKind.TENANT_SALT, "bc")]
    assert encode_extra_keys(k1) != encode_extra_keys(k2)


def test_large_token_ids_are_encoded_exactly():
    assert hash_block(None, [2**40], b"") != hash_block(None, [0], b"")
    assert hash_block(None, [1, 2], b"") != hash_block(None, [2, 1], b"")
