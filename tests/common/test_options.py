"""Service config from flags, then PAGEDSERVE_* variables, then defaults."""

from __future__ import annotations

import argparse
import logging

import pytest

from pagedserve.common import options
from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.serve_config import ServeConfig


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    options.add_arguments(parser, ServeConfig)
    options.add_arguments(parser, EngineConfig)
    return parser.parse_args(list(argv))


def test_flags_beat_environment_beat_defaults():
    args = _parse("--port", "9001", "--no-enable-prefix-caching", "--kv-cache-memory", "1048576")
    env = {"PAGEDSERVE_PORT": "9999", "PAGEDSERVE_MAX_QUEUED_REQUESTS": "7", "PAGEDSERVE_REDIS_URL": "redis://h:1/0",
           "PAGEDSERVE_ENABLE_CHUNKED_PREFILL": "false", "PAGEDSERVE_MAX_MODEL_LEN": "none"}
    serve = options.build(ServeConfig, args, env)
    engine = options.build(EngineConfig, args, env)
    assert (serve.port, serve.max_queued_requests, serve.redis_url, serve.host) == (9001, 7, "redis://h:1/0", "127.0.0.1")
    assert (engine.enable_prefix_caching, engine.enable_chunked_prefill, engine.kv_cache_memory, engine.max_model_len) \
        == (False, False, 1048576, None)


def test_to_flags_rebuilds_the_same_config():
    serve = ServeConfig(port=9002, redis_url="redis://x:2/0", worker_timeout=4.5)
    engine = EngineConfig(enable_prefix_caching=False, max_num_seqs=3, dtype="bfloat16")
    args = _parse(*options.to_flags(serve), *options.to_flags(engine))
    assert options.build(ServeConfig, args, {}) == serve
    assert options.build(EngineConfig, args, {}) == engine


def test_bad_values_name_the_field():
    with pytest.raises(InvalidParameterError) as err:
        options.build(ServeConfig, None, {"PAGEDSERVE_PORT": "eighty"})
    assert err.value.param == "port"
    with pytest.raises(InvalidParameterError) as err:
        options.build(ServeConfig, _parse("--worker-timeout", "1", "--heartbeat-interval", "1"), {})
    assert err.value.param == "worker_timeout"


def test_memory_sizes_take_units():
    args = _parse("--kv-tier-memory", "8GiB", "--kv-cache-memory", "512MiB")
    engine = options.build(EngineConfig, args, {"PAGEDSERVE_REDIS_MAXMEMORY": "2GB"})
    assert (engine.kv_tier_memory, engine.kv_cache_memory) == (8 << 30, 512 << 20)
    assert options.build(ServeConfig, None, {"PAGEDSERVE_REDIS_MAXMEMORY": "2GB"}).redis_maxmemory == 2 * 10**9
    with pytest.raises(InvalidParameterError) as err:
        options.build(EngineConfig, _parse("--kv-tier-memory", "lots"), {})
    assert err.value.param == "kv_tier_memory"


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ((), {}, "auto"),  # nothing said: the serve commands' default (int8 on CPU, resolved by the worker)
    (("--quantization", "none"), {}, "none"),
    ((), {"PAGEDSERVE_QUANTIZATION": "none"}, "none"),  # not read as "unset"
    ((), {"PAGEDSERVE_QUANTIZATION": "int4"}, "int4"),
    (("--quantization", "int8"), {"PAGEDSERVE_QUANTIZATION": "none"}, "int8"),
])
def test_serve_and_worker_default_to_auto_quantization(monkeypatch, argv, env, expected):
    from pagedserve.entrypoints.cli import _service_configs, build_parser

    monkeypatch.delenv("PAGEDSERVE_QUANTIZATION", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    root, level = logging.getLogger(), logging.getLogger().level
    try:
        for command in ("serve", "worker"):
            _, engine = _service_configs(build_parser().parse_args([command, *argv]))
            assert engine.quantization == expected
            # what `serve` hands each worker process on its command line keeps the choice
            flags = options.to_flags(engine)
            assert flags[flags.index("--quantization") + 1] == expected
    finally:
        root.setLevel(level)  # _service_configs sets it from --log-level
    assert EngineConfig().quantization is None  # the in-process engine keeps its weights as given
