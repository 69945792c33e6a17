"""The shared KV tier with real engines: blocks one engine's pool evicts are loaded by
another engine instead of recomputed, with identical greedy tokens; tenants never share
them; a tier that is unreachable or full costs recomputation, never a failure."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve import SamplingParams
from pagedserve.common.redis_server import EmbeddedRedis
from pagedserve.engine.engine import Engine

from engine_helpers import assert_pool_clean
from serve_helpers import wait_until

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V × layers × block size × KV heads × head dim × float32
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis().start()
    yield server.url
    server.stop()


def engine(model_dir, redis_url: str | None, num_blocks: int = 12, tier_memory: int = 64 << 20, **kw) -> Engine:
    return Engine(model=str(model_dir), dtype="float32", device="cpu", kv_cache_memory=num_blocks * BLOCK_BYTES,
                  max_num_batched_tokens=64, kv_tier_memory=tier_memory if redis_url else 0, kv_tier_url=redis_url,
                  **kw)


def run(eng: Engine, prompt: list[int], request_id: str, salt: str | None = None) -> list[int]:
    eng.add_request(request_id, prompt, GREEDY, cache_salt=salt)
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for delta in eng.step():
            tokens += [t for d in delta.deltas for t in d.token_ids]
    return tokens


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=length).tolist() for _ in range(n)]


def fill_tier(model_dir, url: str, prompt: list[int], salt: str | None = None) -> Engine:
    """An engine with a 12-block pool serves `prompt` (101 tokens: 6 full blocks), then two
    other prompts that evict all of it, so its 6 blocks go to the tier."""
    writer = engine(model_dir, url)
    run(writer, prompt, "first", salt)
    for i, other in enumerate(prompts(seed=7, n=2, length=150)):
        run(writer, other, f"other-{i}")
    writer.close()  # the writer thread has put everything
    return writer


def test_blocks_evicted_by_one_engine_are_loaded_by_another_with_identical_tokens(tiny_checkpoint, redis_url):
    model_dir = tiny_checkpoint("llama-gqa")
    prompt = prompts(seed=1, n=1, length=101)[0]
    reference = run(engine(model_dir, None), prompt, "ref")  # no tier: everything computed
    writer = fill_tier(model_dir, redis_url, prompt)
    assert writer.kv_tier is not None and writer.kv_tier.counters.blocks_saved >= 6
    assert writer.kv_tier.store.stats.errors == 0

    reader = engine(model_dir, redis_url)
    assert run(reader, prompt, "again") == reference
    tier = reader.kv_tier
    assert tier is not None
    assert tier.counters.blocks_loaded == 6  # every full block the prompt may reuse ((101 - 1) // 16)
    stats = reader.kv_manager.pool.stats
    assert (stats.num_queries, stats.num_hits, stats.num_tier_hits) == (6, 6, 6)
    # served again from its own pool now: a hit, no longer a tier hit
    assert run(reader, prompt, "third") == reference
    assert (stats.num_hits, stats.num_tier_hits, tier.counters.blocks_loaded) == (12, 6, 6)
    assert_pool_clean(reader)


def test_tenants_never_load_each_others_blocks(tiny_checkpoint, redis_url):
    model_dir = tiny_checkpoint("llama-gqa")
    prompt = prompts(seed=2, n=1, length=101)[0]
    fill_tier(model_dir, redis_url, prompt, salt="tenant-a")
    other = engine(model_dir, redis_url)
    tokens_b = run(other, prompt, "b", salt="tenant-b")
    assert other.kv_tier is not None and other.kv_tier.counters.blocks_loaded == 0
    assert other.kv_manager.pool.stats.num_tier_hits == 0
    same = engine(model_dir, redis_url)
    assert run(same, prompt, "a", salt="tenant-a") == tokens_b
    assert same.kv_manager.pool.stats.num_tier_hits == 6


def test_an_unreachable_tier_recomputes_and_fails_nothing(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama-gqa")
    prompt = prompts(seed=3, n=1, length=101)[0]
    reference = run(engine(model_dir, None), prompt, "ref")
    eng = engine(model_dir, "redis://127.0.0.1:1/0")  # nothing listens there
    assert run(eng, prompt, "x") == reference
    for i, other in enumerate(prompts(seed=8, n=2, length=150)):
        run(eng, other, f"evict-{i}")  # evictions go to a writer that cannot write
    eng.close()
    assert eng.kv_tier is not None
    assert eng.kv_tier.store.stats.errors >= 2  # one failed lookup, one or more failed puts
    assert eng.kv_manager.pool.stats.num_tier_hits == 0
    assert_pool_clean(eng)


def test_a_lookup_that_outlives_its_timeout_releases_the_request(tiny_checkpoint, redis_url):
    model_dir = tiny_checkpoint("llama-gqa")
    prompt = prompts(seed=4, n=1, length=101)[0]
    eng = engine(model_dir, redis_url, kv_tier_timeout=0.05)
    assert eng.kv_tier is not None
    release = __import__("threading").Event()
    slow_get = eng.kv_tier.store.get_leading

    def stuck(hashes):
        release.wait(5)
        return slow_get(hashes)

    eng.kv_tier.store.get_leading = stuck  # type: ignore[method-assign]
    try:
        tokens = run(eng, prompt, "slow")
    finally:
        release.set()
    assert len(tokens) == 8
    assert eng.kv_tier.counters.lookups_timed_out == 1
    wait_until(lambda: eng.kv_tier is not None and eng.kv_tier.num_held == 0, "nothing held")
    assert_pool_clean(eng)


def test_an_aborted_request_waiting_for_its_lookup_is_forgotten(tiny_checkpoint, redis_url):
    model_dir = tiny_checkpoint("llama-gqa")
    eng = engine(model_dir, redis_url)
    prompt = prompts(seed=5, n=1, length=101)[0]
    eng.add_request("gone", prompt, GREEDY)
    assert eng.kv_tier is not None and eng.kv_tier.num_held == 1
    assert list(eng.kv_manager._hashes) == ["gone"]  # the lookup hashed its prompt
    eng.abort_request("gone")
    assert eng.kv_tier.num_held == 0
    assert eng.kv_manager._hashes == {}  # and nothing of it stays behind
    assert not eng.has_unfinished_requests()
    assert eng.step() == []
    assert_pool_clean(eng)


INT8_BLOCK_BYTES = 2 * 2 * 16 * 2 * (16 + 4)  # K and V × layers × block size × KV heads × (16 int8 + a float32 scale)


def test_an_int8_pool_round_trips_its_blocks_with_their_scales_and_a_float_pool_never_loads_them(
        tiny_checkpoint, redis_url):
    """int8 blocks travel byte for byte (the scales are inside the rows): a second int8 engine
    loads all 6 and generates what computing them gives; a float32 engine finds none."""
    model_dir = tiny_checkpoint("llama-gqa")
    prompt = prompts(seed=6, n=1, length=101)[0]

    def int8_engine(url):
        return Engine(model=str(model_dir), dtype="float32", device="cpu", kv_cache_memory=12 * INT8_BLOCK_BYTES,
                      max_num_batched_tokens=64, kv_tier_memory=64 << 20 if url else 0, kv_tier_url=url,
                      kv_cache_dtype="int8")

    computed = int8_engine(None)
    assert computed.runner.kv_caches[0].shape[-1] == 20 and computed.runner.num_blocks == 12
    reference = run(computed, prompt, "ref")
    writer = int8_engine(redis_url)
    assert writer.kv_tier is not None and writer.kv_tier.layout.block_bytes == INT8_BLOCK_BYTES
    assert writer.kv_tier.layout.key() == f"{model_dir}|int8|b16|l2|h2|d16"
    run(writer, prompt, "first")
    for i, other in enumerate(prompts(seed=9, n=2, length=150)):
        run(writer, other, f"other-{i}")  # they evict all of the first prompt's blocks
    writer.close()
    assert writer.kv_tier.counters.blocks_saved >= 6 and writer.kv_tier.store.stats.errors == 0

    reader = int8_engine(redis_url)
    assert run(reader, prompt, "again") == reference
    assert reader.kv_tier is not None and reader.kv_tier.counters.blocks_loaded == 6
    assert reader.kv_manager.pool.stats.num_tier_hits == 6
    assert_pool_clean(reader)

    float_engine = engine(model_dir, redis_url)
    run(float_engine, prompt, "float")
    assert float_engine.kv_tier is not None and float_engine.kv_tier.counters.blocks_loaded == 0
    assert float_engine.kv_manager.pool.stats.num_tier_hits == 0
