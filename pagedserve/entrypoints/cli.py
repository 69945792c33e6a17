"""The `pagedserve` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedserve.bench.subcommands import add_bench_parsers
from pagedserve.common.engine_config import DEFAULT_MODEL
from pagedserve.common.errors import InvalidParameterError, PagedServeError


def _generate(args) -> int:
    from pagedserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": p} for p in args.prompt][:1], params)
    else:
        outputs = llm.generate(list(args.prompt), params)
    for out in outputs:
        print(out.outputs[0].text)
    return 0


def _chat(args) -> int:
    """A terminal chat on the engine, streaming each answer as it is generated."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    engine = llm.engine
    history: list[dict[str, str]] = []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    runner = engine.runner
    print(f"pagedserve chat on {args.model} ({runner.device}, {str(runner.dtype).removeprefix('torch.')}); Ctrl-D to quit")
    turn = 0
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        history.append({"role": "user", "content": line})
        turn += 1
        engine.add_request(f"chat-{turn}", llm.apply_chat_template(history), params)
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                for delta in out.deltas:
                    print(delta.text, end="", flush=True)
                    reply += delta.text
        print()
        history.append({"role": "assistant", "content": reply})


def _plan(args) -> int:
    from pagedserve.common.planner import ModelShape, format_plan, parse_bytes, plan

    lengths = None
    if args.lengths:
        if args.lengths.startswith("uniform:"):
            low, high = (int(x) for x in args.lengths.removeprefix("uniform:").split(":"))
            lengths = list(range(low, high + 1))
        else:
            lengths = [int(x) for x in args.lengths.split(",")]
    result = plan(ModelShape.from_path(args.model), parse_bytes(args.memory), args.context, args.dtype,
                  args.kv_dtype, args.block_size, args.reserve, lengths, args.quantization,
                  args.tensor_parallel_size)
    print(format_plan(result, args.context))
    return 0


def _service_configs(args):
    import msgspec

    from pagedserve.common import options
    from pagedserve.common.engine_config import EngineConfig
    from pagedserve.common.serve_config import ServeConfig

    config = options.build(ServeConfig, args)
    logging.getLogger().setLevel(config.log_level.upper())
    engine = options.build(EngineConfig, args)
    if engine.quantization is None:  # not given (the environment's "none" also reads as None)
        said = os.environ.get("PAGEDSERVE_QUANTIZATION", "").strip().lower()
        engine = msgspec.structs.replace(engine, quantization="none" if said == "none" else "auto")
    return config, engine


def _serve(args) -> int:
    from pagedserve.entrypoints.launcher import serve

    return serve(*_service_configs(args))


def _require_redis_url(config) -> str:
    if not config.redis_url:
        raise InvalidParameterError("redis_url", "is required (--redis-url or PAGEDSERVE_REDIS_URL)")
    return config.redis_url


def _gateway(args) -> int:
    from pagedserve.gateway.server import run_gateway

    config, engine = _service_configs(args)
    run_gateway(config, engine, _require_redis_url(config))
    return 0


def _worker(args) -> int:
    from pagedserve.worker.service import run_worker

    config, engine = _service_configs(args)
    run_worker(config, engine, _require_redis_url(config))
    # Drained: exit now. The interpreter's teardown of torch and the model takes seconds on a
    # busy CPU, and `serve` waits for its workers before it stops Redis; nothing is left to
    # release that the operating system does not.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _prefix_cache(args) -> int:
    """The prefix cache service in the foreground, until SIGINT or SIGTERM."""
    import signal
    import threading

    from pagedserve.prefix_cache.index_service import PrefixCacheService

    redis_url = args.redis_url or os.environ.get("PAGEDSERVE_REDIS_URL")
    if not redis_url:
        raise InvalidParameterError("redis_url", "is required (--redis-url or PAGEDSERVE_REDIS_URL)")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    service = PrefixCacheService(redis_url, max_body_bytes=args.max_body_bytes).start(args.host, args.port)
    print(f"prefix cache service on http://{args.host}:{service.port} (workers publish with --kv-events)", flush=True)
    stop.wait()
    service.stop()
    return 0


def _models_pull(args) -> int:
    from pagedserve.common.model_store import pull

    print(pull(args.name, force=args.force))
    return 0


def _models_list(args) -> int:
    from pagedserve.common.model_store import KNOWN_MODELS, is_pulled, model_dir

    for alias, known in sorted(KNOWN_MODELS.items()):
        state = f"pulled at {model_dir(alias)}" if is_pulled(alias) else "not pulled"
        print(f"{alias}\t{known.license}\t{state}")
    return 0


def _plugins_list(args) -> int:
    from pagedserve.plugins import GROUPS, registry

    for kind, group in GROUPS.items():
        print(f"{group}:")
        for name, factory in sorted(registry.available(kind).items()):
            print(f"  {name}\t{factory.__module__}.{factory.__qualname__}")
        for name, why in sorted(registry.broken(kind).items()):
            print(f"  {name}\tSKIPPED: {why}")
    return 0


def _add_engine_arguments(parser: argparse.ArgumentParser, max_tokens: int, temperature: float, top_p: float) -> None:
    """The model and sampling flags shared by `generate` and `chat`."""
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=temperature)
    parser.add_argument("--top-p", type=float, default=top_p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference server")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from prompts, in this process")
    gen.add_argument("prompt", nargs="+")
    _add_engine_arguments(gen, max_tokens=64, temperature=0.0, top_p=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the first prompt")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="chat with a model in the terminal, in this process")
    _add_engine_arguments(chat, max_tokens=256, temperature=0.7, top_p=0.9)
    chat.set_defaults(func=_chat)

    from pagedserve.common import options
    from pagedserve.common.engine_config import EngineConfig
    from pagedserve.common.serve_config import ServeConfig

    for name, func, text in (
        ("serve", _serve, "the OpenAI server: its own Redis (unless --redis-url), the workers and the gateway"),
        ("gateway", _gateway, "only the HTTP gateway, against --redis-url"),
        ("worker", _worker, "only a worker, against --redis-url"),
    ):
        service = sub.add_parser(name, help=text, description=text + ". Every flag also reads PAGEDSERVE_<FLAG>.")
        options.add_arguments(service, ServeConfig)
        # --quantization: its own help, since these commands default it to auto (_service_configs)
        options.add_arguments(service, EngineConfig, skip=("quantization",))
        service.add_argument("--quantization", dest="quantization", default=None, metavar="QUANTIZATION",
                             help="(env PAGEDSERVE_QUANTIZATION) weights: auto (the default: int8 with its LM head "
                                  "for a float32 model on CPU, none elsewhere), none (as the checkpoint has them), "
                                  "or a method: int8, int4, int4_g128, int4_asym, int4_g128_asym")
        service.set_defaults(func=func)

    cache = sub.add_parser("prefix-cache", help="the prefix cache service: the cluster's index of cached blocks")
    cache.add_argument("--redis-url", default=None, help="the queue's Redis (env PAGEDSERVE_REDIS_URL)")
    cache.add_argument("--host", default="127.0.0.1")
    cache.add_argument("--port", type=int, default=8300)
    cache.add_argument("--max-body-bytes", type=int, default=None,
                       help="the largest /lookup body, larger: 413 (default 2 MiB: 65536 hashes of 32 bytes)")
    cache.set_defaults(func=_prefix_cache)

    pl = sub.add_parser("plan", help="KV-cache capacity: sequences that fit, and what paging saves")
    pl.add_argument("--model", required=True, help="a checkpoint directory or a config.json")
    pl.add_argument("--memory", required=True, help="accelerator memory, e.g. 80GiB")
    pl.add_argument("--context", type=int, required=True, help="tokens per sequence (prompt + output)")
    pl.add_argument("--dtype", default="bfloat16")
    pl.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default=None,
                    help="KV cache element type (default: --dtype); int8 rows count their float32 scale, fp8_e4m3 none")
    pl.add_argument("--quantization", default=None, help="weights: int8 (linear layers, per-channel scales), int4, int4_g128, int4_asym, int4_g128_asym (groups of 32 or 128 inputs; _asym: zero points)")
    pl.add_argument("--block-size", type=int, default=16)
    pl.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="devices the model is split across (--memory is each one's)")
    pl.add_argument("--reserve", type=float, default=0.0, help="share of memory kept for activations")
    pl.add_argument("--lengths", default=None, help="typical sequence lengths: 'uniform:LO:HI' or '100,900,...'")
    pl.set_defaults(func=_plan)

    add_bench_parsers(sub)

    models = sub.add_parser("models", help="fetch and list models").add_subparsers(dest="models_command", required=True)
    pull = models.add_parser("pull", help="fetch and convert a known model into the cache")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    pull.add_argument("--force", action="store_true")
    pull.set_defaults(func=_models_pull)
    models.add_parser("list", help="known models and whether they are pulled").set_defaults(func=_models_list)

    plugins = sub.add_parser("plugins", help="installed plugins").add_subparsers(dest="plugins_command", required=True)
    plugins.add_parser("list", help="every plugin found through entry points").set_defaults(func=_plugins_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except PagedServeError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
