"""KV-cache capacity planning: how many sequences fit, and what paging saves.

Pure arithmetic over a model's config.json (and its safetensors headers when the
checkpoint is there), so it runs anywhere, without torch.

    KV bytes per token = 2 (K and V) × layers × KV heads × bytes per row
    bytes per row      = head_dim × bytes per element, + a float32 scale (4 bytes) for int8

The rows are those the workers allocate (`--kv-cache-dtype`, kernels/reference_ops.py):
an int8 row is head_dim int8 values followed by its float32 scale; an fp8_e4m3 row is
head_dim fp8 values with no scale.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pagedserve.common.contracts.parallel import tensor_parallel_sizes_problem
from pagedserve.common.errors import InvalidParameterError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "int8": 1}
#: KV element types whose rows carry a float32 scale after their values (one per token,
#: layer, K or V, and KV head); fp8 rows carry none
SCALED_KV = ("int8",)
SCALE_BYTES = 4  # a float32 scale
#: weight quantization methods `plan` counts: bytes per weight of a linear layer; each
#: output channel also keeps one float32 scale. Embeddings and the LM head stay in --dtype.
WEIGHT_QUANTIZATION_BYTES = {"int8": 1}
#: the int4 methods (plugins/int4_quantization.py): name → (group size, zero points). Each
#: linear layer's inputs are padded to whole groups; per output row and group it keeps
#: group / 2 bytes of packed codes, a float16 scale and, with zero points, a uint8 zero point.
INT4_METHODS = {"int4": (32, False), "int4_g128": (128, False), "int4_asym": (32, True),
                "int4_g128_asym": (128, True)}
INT4_SCALE_BYTES = 2  # a float16 group scale
ZERO_POINT_BYTES = 1
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB', '1.5 GB', '4096' → bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidParameterError("memory", f"cannot read {text!r} as a size (e.g. 80GiB, 24GB, 1.5TiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the plan needs from a config.json."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_parameters: int  # counted from the safetensors headers, else estimated from the config
    num_linear_parameters: int = 0  # of those, the weights of the decoder layers' linear layers
    num_linear_outputs: int = 0  # their output channels (one scale each when quantized)
    num_heads: int = 0  # query heads (0: unknown), for the tensor-parallel size check
    intermediate_size: int = 0  # the MLP's (0: unknown)
    linear_layers: tuple[tuple[int, int], ...] = ()  # (inputs, outputs) of each linear layer of one decoder layer
    #: a GPTQ / AWQ checkpoint's int4 layout as it loads (group size, zero points); None: a float checkpoint
    prequantized: tuple[int, bool] | None = None

    @classmethod
    def from_path(cls, path: str | Path) -> ModelShape:
        """A checkpoint directory or a config.json file."""
        path = Path(path)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise InvalidParameterError("model", f"{path} is neither a config.json nor a directory holding one")
        cfg = json.loads(config_file.read_text())
        cfg = cfg.get("text_config", cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        prequantized = _prequantized(cfg)
        # a pre-quantized checkpoint's safetensors hold packed int32 words: its float shape counts
        params = ((_count_safetensors(config_file.parent) if prequantized is None else None)
                  or _estimate_parameters(cfg, head_dim, kv_heads))
        linear, outputs = _linear_shapes(cfg, head_dim, kv_heads)
        return cls(cfg["num_hidden_layers"], kv_heads, head_dim, params, linear, outputs, heads,
                   cfg.get("intermediate_size", 0), _linear_layers(cfg, head_dim, kv_heads), prequantized)

    def on_rank(self, tensor_parallel_size: int) -> ModelShape:
        """One rank's share under tensor parallelism: its KV heads (one, replicated, when
        there are fewer than ranks) and about 1/N of the weights (the norms, which every rank
        holds whole, are a rounding error)."""
        if tensor_parallel_size == 1:
            return self
        if self.num_heads and self.intermediate_size:
            problem = tensor_parallel_sizes_problem(tensor_parallel_size, num_heads=self.num_heads,
                                                    num_kv_heads=self.num_kv_heads,
                                                    intermediate_size=self.intermediate_size)
            if problem is not None:
                raise InvalidParameterError("tensor_parallel_size", problem)
        n = tensor_parallel_size
        return replace(self, num_kv_heads=max(1, self.num_kv_heads // n), num_parameters=-(-self.num_parameters // n),
                       num_linear_parameters=-(-self.num_linear_parameters // n),
                       num_linear_outputs=-(-self.num_linear_outputs // n),
                       linear_layers=tuple((k, -(-out // n)) for k, out in self.linear_layers))

    def kv_bytes_per_row(self, kv_dtype: str) -> int:
        """One token's K (or V) of one KV head: head_dim elements, and an int8 row's scale."""
        return self.head_dim * DTYPE_BYTES[kv_dtype] + (SCALE_BYTES if kv_dtype in SCALED_KV else 0)

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V of every layer and KV head, scales included."""
        return 2 * self.num_layers * self.num_kv_heads * self.kv_bytes_per_row(kv_dtype)

    def kv_bytes_per_block(self, kv_dtype: str, block_size: int) -> int:
        """A block's K/V of every layer (its scales are inside its rows)."""
        return self.kv_bytes_per_token(kv_dtype) * block_size

    def weight_bytes(self, dtype: str, quantization: str | None = None) -> int:
        """The weights in memory: all in `dtype`, or the linear layers quantized (1 byte a
        weight for int8, plus a float32 scale per output channel; int4: `int4_linear_bytes`)
        and the rest in `dtype`."""
        int4 = self.prequantized if quantization is None else INT4_METHODS.get(quantization)
        if quantization is None and int4 is None:
            return self.num_parameters * DTYPE_BYTES[dtype]
        rest = self.num_parameters - self.num_linear_parameters
        if int4 is not None:  # int4 at load, or a GPTQ / AWQ checkpoint as it loads
            return self.int4_linear_bytes(*int4) + rest * DTYPE_BYTES[dtype]
        assert quantization is not None
        return (self.num_linear_parameters * WEIGHT_QUANTIZATION_BYTES[quantization]
                + self.num_linear_outputs * SCALE_BYTES + rest * DTYPE_BYTES[dtype])


    def int4_linear_bytes(self, group: int, zeros: bool) -> int:
        """The decoder layers' linear layers in the int4 layout: per output row and group of
        `group` inputs (the last one padded), group / 2 bytes of codes, a float16 scale and a
        uint8 zero point when `zeros`."""
        per_group = group // 2 + INT4_SCALE_BYTES + (ZERO_POINT_BYTES if zeros else 0)
        return self.num_layers * sum(out * -(-k // group) * per_group for k, out in self.linear_layers)


def _prequantized(cfg: dict) -> tuple[int, bool] | None:
    """(group size, zero points) of a GPTQ / AWQ / compressed-tensors 4-bit checkpoint (a group
    per row counts as hidden_size); None for any other: counted as float, the loader refuses it."""
    qc = cfg.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":  # the first scheme's weights (the loader takes one scheme)
        w = dict(next(iter((qc.get("config_groups") or {}).values()), {})).get("weights") or {}
        bits, group, zeros = w.get("num_bits"), int(w.get("group_size") or -1), not w.get("symmetric", True)
    else:  # GPTQ's symmetric checkpoints have every zero point 8: they load without a zeros tensor
        bits, group = qc.get("bits", qc.get("w_bit")), int(qc.get("group_size", qc.get("q_group_size", -1)))
        zeros = not (method == "gptq" and qc.get("sym", True))
    if method not in ("gptq", "awq", "compressed-tensors") or bits != 4:
        return None
    return (group if group > 0 else cfg["hidden_size"]), zeros


def _linear_layers(cfg: dict, head_dim: int, kv_heads: int) -> tuple[tuple[int, int], ...]:
    """(inputs, outputs) of a Llama-style decoder layer's linear layers, q/k/v and gate/up fused."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * head_dim, kv_heads * head_dim
    return ((h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h))


def _linear_shapes(cfg: dict, head_dim: int, kv_heads: int) -> tuple[int, int]:
    """Weights and output channels of a Llama-style decoder's linear layers (q, k, v, o,
    gate, up, down), every layer."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * head_dim, kv_heads * head_dim
    weights = h * (q + 2 * kv) + q * h + 3 * h * inter
    outputs = (q + 2 * kv) + h + 2 * inter + h
    return cfg["num_hidden_layers"] * weights, cfg["num_hidden_layers"] * outputs


def _estimate_parameters(cfg: dict, head_dim: int, kv_heads: int) -> int:
    """Parameters of a Llama-style decoder (attention, SwiGLU MLP, two norms per layer)."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * head_dim
    kv = kv_heads * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg["intermediate_size"] + 2 * h
    embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return cfg["num_hidden_layers"] * per_layer + embeddings + h


def _count_safetensors(model_dir: Path) -> int | None:
    """Exact parameter count from the safetensors headers (no tensor data is read)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


@dataclass(frozen=True, slots=True)
class Plan:
    """The answer of `pagedserve plan`."""

    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int  # at the full context, rounded up to whole blocks
    kv_budget_bytes: int  # memory left for the KV cache once the weights are in
    max_sequences_at_context: int  # concurrent sequences that each reach the full context
    num_blocks: int
    tensor_parallel_size: int  # devices the model is split across; the bytes above are per device
    # Given a length distribution: sequences that fit when each reserves the full context,
    # against sequences that fit when each holds only the blocks its length needs.
    sequences_reserving_context: int | None = None
    sequences_paged: int | None = None
    mean_length: float | None = None

    @property
    def paged_gain(self) -> float | None:
        if self.sequences_paged is None or not self.sequences_reserving_context:
            return None
        return self.sequences_paged / self.sequences_reserving_context


def plan(
    shape: ModelShape,
    memory_bytes: int,
    context: int,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    block_size: int = 16,
    reserved_fraction: float = 0.0,
    lengths: Sequence[int] | None = None,
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
) -> Plan:
    """Capacity of `memory_bytes` for this model at `context` tokens per sequence.

    `reserved_fraction` keeps part of the memory for activations and the runtime.
    `lengths`, if given, are typical sequence lengths (prompt + output) of the traffic.
    `quantization` (int8, int4, int4_g128, int4_asym, int4_g128_asym) counts the linear
    layers' weights quantized (a GPTQ / AWQ checkpoint's are, without it); `kv_dtype` int8
    counts head_dim + 4 bytes per row (its float32 scale), fp8_e4m3 head_dim bytes.
    `tensor_parallel_size` N splits the weights and the KV heads over N devices of
    `memory_bytes` each: the bytes are per device, the sequences the whole worker's.
    """
    if tensor_parallel_size < 1:
        raise InvalidParameterError("tensor_parallel_size", "must be >= 1")
    shape = shape.on_rank(tensor_parallel_size)
    methods = [*WEIGHT_QUANTIZATION_BYTES, *INT4_METHODS]
    if quantization is not None and quantization not in methods:
        raise InvalidParameterError("quantization", f"must be one of {', '.join(methods)}, got {quantization!r}")
    for name, value in (("dtype", dtype), ("kv_dtype", kv_dtype or dtype)):
        if value not in DTYPE_BYTES:
            raise InvalidParameterError(name, f"must be one of {', '.join(DTYPE_BYTES)}, got {value!r}")
    if context < 1 or block_size < 1:
        raise InvalidParameterError("context", "context and block size must be positive")
    kv_dtype = kv_dtype or dtype
    weight_bytes = shape.weight_bytes(dtype, quantization)
    per_token = shape.kv_bytes_per_token(kv_dtype)
    per_block = shape.kv_bytes_per_block(kv_dtype, block_size)
    budget = int(memory_bytes * (1 - reserved_fraction)) - weight_bytes
    if budget <= 0:
        raise InvalidParameterError("memory", f"the weights alone ({weight_bytes / 2**30:.2f} GiB) do not fit")
    num_blocks = budget // per_block
    blocks_per_seq = -(-context // block_size)
    max_sequences = num_blocks // blocks_per_seq
    sequences_paged: int | None = None
    mean_length: float | None = None
    if lengths:
        lengths = [min(n, context) for n in lengths]
        mean_blocks = sum(-(-n // block_size) for n in lengths) / len(lengths)
        sequences_paged = int(num_blocks // mean_blocks)
        mean_length = sum(lengths) / len(lengths)
    return Plan(
        weight_bytes=weight_bytes, kv_bytes_per_token=per_token, kv_bytes_per_sequence=blocks_per_seq * per_block,
        kv_budget_bytes=budget, max_sequences_at_context=max_sequences, num_blocks=num_blocks,
        tensor_parallel_size=tensor_parallel_size,
        sequences_reserving_context=max_sequences if lengths else None,
        sequences_paged=sequences_paged, mean_length=mean_length,
    )


def format_plan(p: Plan, context: int) -> str:
    gib = 2**30
    rows = [
        ("weights", f"{p.weight_bytes / gib:.2f} GiB"),
        ("KV cache per token", f"{p.kv_bytes_per_token / 1024:.1f} KiB"),
        (f"KV cache per {context}-token sequence", f"{p.kv_bytes_per_sequence / gib:.3f} GiB"),
        ("KV cache budget", f"{p.kv_budget_bytes / gib:.2f} GiB ({p.num_blocks} blocks)"),
        ("sequences at full context", f"{p.max_sequences_at_context}"),
    ]
    if p.tensor_parallel_size > 1:
        rows.insert(0, ("tensor parallel", f"{p.tensor_parallel_size} devices; weights and KV cache per device"))
    if p.sequences_paged is not None:
        rows += [
            ("mean sequence length", f"{p.mean_length:.1f} tokens"),
            ("sequences, full-context reservation", f"{p.sequences_reserving_context}"),
            ("sequences, paged blocks", f"{p.sequences_paged} ({p.paged_gain:.1f}x)"),
        ]
    return "\n".join(f"{label:38}{value}" for label, value in rows)
