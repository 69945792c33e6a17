"""`pagedserve bench offline --profile`: where one decode step's time goes.

For a batch of 1 and a batch of 64 sequences in their decode phase, it times each stage of
`Engine.step` and splits the model's forward into linear layers, attention and the other
ops:

    schedule | prepare (ModelInput) | forward = linear + attention + other | sample | output

`output` is everything in the step after `ModelRunner.run`: the scheduler's update, the
output processor (detokenizing, stop strings) and the step's statistics. `host overhead`
is the step minus its linear layers: what a decode step costs beyond reading the weights.

How the forward is split: the fused CPU step (kernels/cpu_decode.py) counts its own stages
in C++; an eager forward is timed by hooks on every linear layer (`nn.Linear`, packed, int8,
int4) and around the attention
backend, which add a few microseconds per call to `other`. The LM head runs in `sample`
(`ModelRunner.compute_logits`); it is counted in `linear`, and `sample` is shown without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedserve.common.sampling_params import SamplingParams

STAGES = ("schedule", "prepare", "forward", "sample", "output")


@dataclass
class StepProfile:
    """Seconds per decode step, averaged over the profiled steps."""

    batch_size: int
    fused: bool  # whether the forward ran in the fused CPU step
    steps: int
    step: float = 0.0
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    linear: float = 0.0  # in the linear layers, the LM head included
    attention: float = 0.0
    other_model: float = 0.0  # the forward's other ops (norms, rotary, activation, KV store, ...)
    lm_head: float = 0.0  # the LM head, part of `linear` and of `stages["sample"]`
    #: tensor parallelism (0 with one rank): rank 0's time in the all-reduces after the
    #: row-parallel layers and the embedding (waiting for the slowest rank included; the LM
    #: head's gather stays in `lm_head`), and in broadcasting the step's inputs
    all_reduce: float = 0.0
    broadcast: float = 0.0

    @property
    def host_overhead(self) -> float:
        return self.step - self.linear

    def rows(self) -> list[tuple[str, float]]:
        """(what, seconds) in the order of the printed table; shares are of `step`."""
        s = self.stages
        return [("linear layers", self.linear), ("attention", self.attention), ("other model ops", self.other_model),
                ("schedule", s["schedule"]), ("prepare inputs", s["prepare"]),
                ("all-reduce (TP)", self.all_reduce), ("step broadcast (TP)", self.broadcast),
                ("sample (without LM head)", max(s["sample"] - self.lm_head, 0.0)), ("output", s["output"])]


class _Timers:
    """Accumulates seconds by name while `on`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.on = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
        return timed


def _is_linear(module: nn.Module) -> bool:
    """A linear layer: `nn.Linear`, or a leaf module that stands in for one (the packed CPU
    linear, the int8 and int4 ones: each has in_features and out_features)."""
    if isinstance(module, nn.Linear):
        return True
    return hasattr(module, "in_features") and hasattr(module, "out_features") and not any(module.children())


@contextmanager
def _instrumented(engine, timers: _Timers) -> Iterator[None]:
    """Time the engine's stages, the linear layers and attention; undone on exit."""
    runner = engine.runner
    patched: list[tuple[object, str]] = []

    def patch(obj: object, attr: str, name: str) -> None:
        setattr(obj, attr, timers.wrap(name, getattr(obj, attr)))
        patched.append((obj, attr))

    patch(engine.scheduler, "schedule", "schedule")
    patch(runner, "run", "run")
    patch(runner, "prepare_inputs", "prepare")
    patch(runner, "forward", "forward")
    patch(runner, "sample", "sample")
    patch(runner, "compute_logits", "lm_head")
    patch(runner.attention_backend, "forward", "attention")
    hooks = []
    for module in runner.model.modules():
        if _is_linear(module):
            hooks.append(module.register_forward_pre_hook(lambda *_: timers.seconds.__setitem__(
                "_linear_start", time.perf_counter()) if timers.on else None))
            hooks.append(module.register_forward_hook(lambda *_: timers.seconds.__setitem__(
                "linear", timers.seconds.get("linear", 0.0) + time.perf_counter() - timers.seconds["_linear_start"])
                if timers.on else None))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for obj, attr in reversed(patched):
            delattr(obj, attr)  # the instance attribute goes; the class's method shows again


def profile_decode(engine, batch_size: int, prompt_len: int = 128, steps: int = 32, seed: int = 0) -> StepProfile:
    """Start `batch_size` requests of `prompt_len` tokens, run their prefill, then profile
    `steps` decode steps of all of them together."""
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.hf_config.vocab_size
    # the first requests decode while later ones are still in their prefill chunks: leave
    # them enough tokens that all `batch_size` still run in every profiled step
    prefill_steps = -(-batch_size * prompt_len // engine.config.max_num_batched_tokens) + 1
    params = SamplingParams(max_tokens=steps + prefill_steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch_size):
        prompt = torch.randint(100, vocab - 100, (prompt_len,), generator=generator).tolist()
        engine.add_request(f"profile-{batch_size}-{i}", prompt, params)
    engine.step()  # at least once: `last_step` may still be an earlier run's decode step
    while engine.last_step is None or engine.last_step.num_batched_tokens != batch_size:
        engine.step()  # the prefill, in chunks, until every request decodes
    fused = engine.runner.fused_decoder
    use_fused = fused is not None and batch_size <= fused.max_batch
    timers = _Timers()
    profile = StepProfile(batch_size=batch_size, fused=use_fused, steps=steps)
    ranks = engine.runner.ranks
    if ranks is not None:
        ranks.group.comm_seconds = ranks.broadcast_seconds = 0.0
    with _instrumented(engine, timers):
        if use_fused:
            fused.set_profile(True)
            fused.take_profile()
        timers.on = True
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
            assert engine.last_step is not None and engine.last_step.num_batched_tokens == batch_size, \
                "a profiled step decoded other than the whole batch"
        total = time.perf_counter() - started
        timers.on = False
        if use_fused:
            linear, attention, other = fused.take_profile()
            fused.set_profile(False)
    while engine.has_unfinished_requests():
        engine.step()
    t = timers.seconds
    profile.step = total / steps
    profile.stages.update(schedule=t.get("schedule", 0.0) / steps, prepare=t.get("prepare", 0.0) / steps,
                          forward=t.get("forward", 0.0) / steps, sample=t.get("sample", 0.0) / steps,
                          output=(total - t.get("schedule", 0.0) - t.get("run", 0.0)) / steps)
    profile.lm_head = t.get("lm_head", 0.0) / steps
    if use_fused:
        forward_linear, profile.attention = linear / steps, attention / steps
    else:
        forward_linear, profile.attention = t.get("linear", 0.0) / steps, t.get("attention", 0.0) / steps
    profile.linear = forward_linear + profile.lm_head
    if ranks is not None:
        profile.all_reduce, profile.broadcast = ranks.group.comm_seconds / steps, ranks.broadcast_seconds / steps
    profile.other_model = max(profile.stages["forward"] - forward_linear - profile.attention - profile.all_reduce, 0.0)
    return profile


def format_profiles(profiles: list[StepProfile]) -> str:
    """The table `bench offline --profile` prints: ms per step and share, per batch size."""
    head = f"{'per decode step':28}" + "".join(
        f"{f'batch {p.batch_size} ' + ('fused' if p.fused else 'eager'):>22}" for p in profiles)
    lines = [head]
    for i, (what, _) in enumerate(profiles[0].rows()):
        cells = "".join(f"{p.rows()[i][1] * 1e3:13.2f} ms {p.rows()[i][1] / p.step:5.1%}" for p in profiles)
        lines.append(f"{what:28}{cells}")
    lines.append(f"{'step (wall)':28}" + "".join(f"{p.step * 1e3:13.2f} ms {'':>5}" for p in profiles))
    lines.append(f"{'host overhead (step-linear)':28}" + "".join(
        f"{p.host_overhead * 1e3:13.2f} ms {p.host_overhead / p.step:5.1%}" for p in profiles))
    lines.append(f"{'decode tok/s':28}" + "".join(f"{p.batch_size / p.step:16.1f} {'':>5}" for p in profiles))
    return "\n".join(lines)


def run_profile(args) -> int:
    """`bench offline --profile`: the table for each batch size, for the default engine and,
    in the same run, for the eager one (`--enforce-eager`)."""
    from pagedserve import LLM
    from pagedserve.kernels.cpu_attention import build_arch

    batches = [int(b) for b in str(args.profile_batches).split(",")]
    tp = getattr(args, "tensor_parallel_size", 1)
    all_reduce = getattr(args, "tensor_parallel_all_reduce", "auto")
    print(f"model={args.model} dtype={args.dtype} threads={args.threads} tensor_parallel_size={tp} "
          f"tensor_parallel_all_reduce={all_reduce} pack_cpu_weights={not getattr(args, 'no_pack_cpu_weights', False)} "
          f"quantization={getattr(args, 'quantization', None)} quantize_lm_head={getattr(args, 'quantize_lm_head', False)} "
          f"torch={torch.__version__} cpu_march={build_arch()} "
          f"prompt={args.profile_prompt} tokens, {args.profile_steps} decode steps per batch")
    for eager in (False, True):
        llm = LLM(args.model, dtype=args.dtype, enforce_eager=eager, max_num_seqs=max(batches),
                  enable_prefix_caching=False, tensor_parallel_size=tp, tensor_parallel_all_reduce=all_reduce,
                  pack_cpu_weights=not getattr(args, "no_pack_cpu_weights", False),
                  quantization=getattr(args, "quantization", None),
                  quantize_lm_head=getattr(args, "quantize_lm_head", False))
        profile_decode(llm.engine, 1, args.profile_prompt, 4, seed=99)  # warm-up
        profiles = [profile_decode(llm.engine, b, args.profile_prompt, args.profile_steps) for b in batches]
        print(f"\n{'eager (--enforce-eager)' if eager else 'default'}:")
        print(format_profiles(profiles))
        llm.close()
    return 0
