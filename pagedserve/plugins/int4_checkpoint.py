"""GPTQ, AWQ and compressed-tensors 4-bit checkpoints, repacked at load into the int4 layout
(plugins/int4_quantization.py).

A checkpoint whose config.json has a `quantization_config` of `quant_method` "gptq", "awq" or
"compressed-tensors"
holds, for each quantized linear layer `P` (P = model.layers.0.self_attn.q_proj, ...):

GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq"):
    P.qweight  int32 [in / 8, out]: input k of column n is bits 4·(k % 8).. of qweight[k // 8, n]
    P.qzeros   int32 [groups, out / 8]: the zero point of column n is bits 4·(n % 8).. of
               qzeros[g, n // 8], stored minus one (so 1 is added back; "gptq_v2" stores it as is)
    P.scales   float16 [groups, out]
    P.g_idx    int32 [in]: each input's group; k // group_size (act-order only with static_groups)
    w[n, k] = (q - z)·s of group g_idx[k]
AWQ (AutoAWQ, `version` "gemm"):
    P.qweight  int32 [in, out / 8]: eight columns a word in the order [0, 2, 4, 6, 1, 3, 5, 7]
               (nibble i, bits 4·i.., holds column 8·(n // 8) + order[i])
    P.qzeros   int32 [groups, out / 8], the same order
    P.scales   float16 [groups, out]
    w[n, k] = (q - z)·s

compressed-tensors (llm-compressor; `format` "pack-quantized", 4-bit int weights, strategy
"group" or "channel", no activation quantization):
    P.weight_packed      int32 [out, ceil(in / 8)]: input k of row n is bits 4·(k % 8).. of
                         weight_packed[n, k // 8], stored as the signed code plus 8
    P.weight_scale       [out, groups] (float16, bfloat16 or float32)
    P.weight_zero_point  asymmetric only: int32 [ceil(out / 8), groups], row n of group g in
                         bits 4·(n % 8).. of word [n // 8, g], the signed zero point plus 8 (an
                         older layout keeps it unpacked: int8 [out, groups], signed)
    P.weight_shape       [2]: out, in (the packing pads in to 8)
    P.weight_g_idx       act-order only (refused unless in input order)
    w[n, k] = (q - z)·s, q and z signed; the stored q + 8 and z + 8 are the int4 layout's code
    and zero point (8: symmetric)

The codes, zero points and scales are moved into the int4 layout (codes transposed to
[out, in] and packed two a byte, zero points as uint8 sixteenths (16·z), scales kept float16; a checkpoint that
stored wider scales has them rounded to float16): no weight is
dequantized to float. Only 4-bit, in-order groups that are a multiple of 32 inputs load;
anything else is refused by `read_format` with the field that says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.plugins.int4_group_fit import float16_values
from pagedserve.plugins.int4_quantization import (
    BLOCK,
    SYMMETRIC_ZERO,
    ZERO_STEPS,
    Int4Linear,
    Int4Weights,
    pack_codes,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
_SHIFTS = torch.arange(8, dtype=torch.int64) * 4


class UnsupportedCheckpoint(ValueError):
    """A quantization_config this loader does not read; `field` names the key that says why."""

    def __init__(self, field: str, message: str):
        super().__init__(f"quantization_config.{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class CheckpointFormat:
    """What `read_format` understood of a checkpoint's quantization_config."""

    method: str  # "gptq", "awq" or "compressed-tensors"
    group_size: int  # inputs per scale; -1 in the config (one group per row) becomes the layer's width
    zero_offset: int  # added to each stored zero point (GPTQ's v1 format stores it minus one)


def read_format(config: dict[str, Any]) -> CheckpointFormat:
    """The format of a `quantization_config`, or `UnsupportedCheckpoint` naming its field."""
    method = str(config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors_format(config)
    if method not in ("gptq", "awq"):
        raise UnsupportedCheckpoint("quant_method", f"{method!r} is not supported (gptq, awq and "
                                                    "compressed-tensors 4-bit are)")
    bits_key = "bits" if "bits" in config else "w_bit"
    bits = config.get(bits_key)
    if bits != 4:
        raise UnsupportedCheckpoint(bits_key, f"{bits}-bit weights are not supported (only 4)")
    group_key = "group_size" if "group_size" in config else "q_group_size"
    group = int(config.get(group_key, -1))
    if group != -1 and (group <= 0 or group % BLOCK):
        raise UnsupportedCheckpoint(group_key, f"group size {group} is not a multiple of {BLOCK}")
    if method == "gptq":
        if config.get("desc_act", False) and not config.get("static_groups", False):  # static: g_idx k // group
            raise UnsupportedCheckpoint("desc_act", "act-order GPTQ (desc_act true, no static_groups) is not supported")
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedCheckpoint("checkpoint_format", f"{fmt!r} is not supported (gptq, gptq_v2)")
        return CheckpointFormat("gptq", group, 1 if fmt == "gptq" else 0)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedCheckpoint("version", f"AWQ {version!r} packing is not supported (gemm)")
    if not config.get("zero_point", True):
        raise UnsupportedCheckpoint("zero_point", "AWQ without zero points is not supported")
    return CheckpointFormat("awq", group, 0)


def _compressed_tensors_format(config: dict[str, Any]) -> CheckpointFormat:
    """compressed-tensors' pack-quantized int4 weights, one scheme for every quantized layer."""
    fmt = str(config.get("format") or "pack-quantized").lower()
    if fmt not in ("pack-quantized", "mixed-precision"):  # mixed: each scheme names its own, checked below
        raise UnsupportedCheckpoint("format", f"compressed-tensors {fmt!r} is not supported (pack-quantized)")
    for key in (k for k in ("sparsity_config", "kv_cache_scheme") if config.get(k)):
        raise UnsupportedCheckpoint(key, "sparse weights and quantized KV caches are not supported")
    groups = config.get("config_groups") or {}
    if not groups:
        raise UnsupportedCheckpoint("config_groups", "no quantization scheme")
    schemes = set()
    for scheme in groups.values():
        if str(scheme.get("format") or fmt).lower() != "pack-quantized":
            raise UnsupportedCheckpoint("format", f"a scheme of format {scheme.get('format')!r} (pack-quantized is)")
        for key in (k for k in ("input_activations", "output_activations") if scheme.get(k)):
            raise UnsupportedCheckpoint(key, "activation quantization is not supported (weights only)")
        w = scheme.get("weights") or {}
        if w.get("num_bits") != 4:
            raise UnsupportedCheckpoint("num_bits", f"{w.get('num_bits')}-bit weights are not supported (only 4)")
        if str(w.get("type", "int")).lower() != "int":
            raise UnsupportedCheckpoint("type", f"{w.get('type')!r} weights are not supported (int)")
        strategy = str(w.get("strategy", "")).lower()
        if strategy not in ("group", "channel"):
            raise UnsupportedCheckpoint("strategy", f"{strategy!r} scales are not supported (group, channel)")
        if w.get("dynamic"):
            raise UnsupportedCheckpoint("dynamic", "dynamic weight quantization is not supported")
        if str(w.get("actorder") or "weight").lower() != "weight":
            raise UnsupportedCheckpoint("actorder", f"act-order groups ({w.get('actorder')!r}) are not supported")
        group = -1
        if strategy == "group":
            group = int(w.get("group_size") or 0)
            if group <= 0 or group % BLOCK:
                raise UnsupportedCheckpoint("group_size", f"group size {group} is not a multiple of {BLOCK}")
        schemes.add(group)
    if len(schemes) > 1:
        raise UnsupportedCheckpoint("config_groups", f"layers quantized with different group sizes {sorted(schemes)}")
    return CheckpointFormat("compressed-tensors", schemes.pop(), 0)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., c] → its eight 4-bit fields, low bits first: int64 [..., c, 8]."""
    return (words.to(torch.int64)[..., None] >> _SHIFTS) & 15


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, out / 8] packed in AWQ's order → int64 [rows, out] in column order."""
    fields = _nibbles(words)  # [rows, c, 8]: field i holds column AWQ_ORDER[i]
    columns = torch.empty_like(fields)
    columns[..., list(AWQ_ORDER)] = fields
    return columns.reshape(words.shape[0], -1)


def repack(fmt: CheckpointFormat, name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           g_idx: torch.Tensor | None = None) -> Int4Weights:
    """One layer's checkpoint tensors in the int4 layout (`name`: for errors)."""
    if fmt.method == "gptq":
        k8, out = qweight.shape
        codes = _nibbles(qweight).permute(0, 2, 1).reshape(8 * k8, out)  # [in, out]
        zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1)[:, :out] + fmt.zero_offset  # [groups, out]
    else:
        codes = _awq_columns(qweight)  # [in, out]
        out = codes.shape[1]
        zeros = _awq_columns(qzeros)[:, :out] + fmt.zero_offset
    k = codes.shape[0]
    group = k if fmt.group_size == -1 else fmt.group_size
    if k % group or group % BLOCK:
        raise UnsupportedCheckpoint("group_size", f"{name}: {k} inputs are not whole groups of {group} "
                                                  f"(a multiple of {BLOCK})")
    if scales.shape != (k // group, out) or zeros.shape != (k // group, out):
        raise ValueError(f"{name}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not fit "
                         f"{k} inputs in groups of {group} and {out} outputs")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group):
        raise UnsupportedCheckpoint("desc_act", f"{name}.g_idx is not in input order (act-order checkpoint)")
    if int(zeros.max()) > 15:  # GPTQ v1 stores zero - 1, so a zero point of 0 comes back as 16
        raise UnsupportedCheckpoint("qzeros", f"{name}: a zero point of {int(zeros.max())} (above 15) does not fit "
                                              "4 bits; re-save the checkpoint as gptq_v2")
    zero_t = (zeros.T * ZERO_STEPS).to(torch.uint8).contiguous()  # whole zero points, in sixteenths
    symmetric = bool((zero_t == SYMMETRIC_ZERO).all())
    return Int4Weights(qweight=pack_codes(codes.T.to(torch.uint8).contiguous()),
                       scales=float16_values(scales.T).half().contiguous(), zeros=None if symmetric else zero_t,
                       group_size=group, in_features=k)


def repack_compressed(fmt: CheckpointFormat, name: str, t: dict[str, torch.Tensor]) -> Int4Weights:
    """One compressed-tensors (pack-quantized) layer's tensors in the int4 layout (`name`: for
    errors). A width that is not whole groups is padded, as `quantize` pads a float weight."""
    missing = [x for x in ("weight_packed", "weight_scale", "weight_shape") if x not in t]
    if missing:
        raise ValueError(f"{name}: the checkpoint lacks {', '.join(missing)}")
    out, k = (int(v) for v in t["weight_shape"].flatten().tolist())
    packed = t["weight_packed"]
    if packed.dtype != torch.int32 or packed.shape != (out, -(-k // 8)):
        raise ValueError(f"{name}: weight_packed {packed.dtype} {tuple(packed.shape)} does not hold {out}x{k} codes")
    codes = _nibbles(packed).reshape(out, -1)[:, :k]  # the signed codes plus 8: the layout's codes
    group = -(-k // BLOCK) * BLOCK if fmt.group_size == -1 else fmt.group_size  # channel: one group a row
    groups = -(-k // group)
    scales = t["weight_scale"].reshape(out, -1)
    if scales.shape[1] != groups:
        raise ValueError(f"{name}: weight_scale {tuple(t['weight_scale'].shape)} does not fit {k} inputs in "
                         f"groups of {group}")
    zeros = None
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        if zp.dtype == torch.int32 and zp.shape == (-(-out // 8), groups):  # packed along the outputs
            z = _nibbles(zp).permute(0, 2, 1).reshape(-1, groups)[:out]
        elif zp.numel() == out * groups:  # unpacked, signed
            z = zp.reshape(out, groups).to(torch.int64) + 8
        else:
            raise ValueError(f"{name}: weight_zero_point {tuple(zp.shape)} does not fit {out} outputs, {groups} groups")
        if int(z.min()) < 0 or int(z.max()) > 15:
            raise UnsupportedCheckpoint("weight_zero_point", f"{name}: a zero point outside the 4-bit range")
        zeros = (z * ZERO_STEPS).to(torch.uint8).contiguous()
        if bool((zeros == SYMMETRIC_ZERO).all()):
            zeros = None
    if "weight_g_idx" in t and not torch.equal(t["weight_g_idx"].to(torch.int64), torch.arange(k) // group):
        raise UnsupportedCheckpoint("actorder", f"{name}.weight_g_idx is not in input order (act-order checkpoint)")
    padded = groups * group
    full = torch.full((out, padded), 8, dtype=torch.uint8)
    full[:, :k] = codes.to(torch.uint8)
    return Int4Weights(qweight=pack_codes(full), scales=float16_values(scales).half().contiguous(), zeros=zeros,
                       group_size=group, in_features=k)


def _concat(parts: list[Int4Weights]) -> Int4Weights:
    """The layouts of several layers with the same inputs stacked along the outputs (q, k, v)."""
    first = parts[0]
    if any(p.group_size != first.group_size or p.in_features != first.in_features for p in parts):
        raise ValueError("the fused layers' parts differ in group size or inputs")
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.full_like(p.scales, SYMMETRIC_ZERO,
                                                                              dtype=torch.uint8) for p in parts])
    return Int4Weights(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), zeros,
                       first.group_size, first.in_features)


_PARTS = ("qweight", "qzeros", "scales", "g_idx",  # GPTQ, AWQ
          "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")  # compressed-tensors


def load_prequantized(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], fmt: CheckpointFormat,
                      packed_modules: dict[str, tuple[str, ...]]) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """Replace every `nn.Linear` of `model` whose tensors the checkpoint holds quantized by an
    `Int4Linear` of them, and hand back the checkpoint's other tensors (for the model's own
    `load_weights`) and the number of layers replaced. `packed_modules`: a model module made
    of several checkpoint layers, stacked along the outputs (qkv_proj: q_proj, k_proj, v_proj)."""
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    rest: list[tuple[str, torch.Tensor]] = []
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in _PARTS:
            quantized.setdefault(prefix.removeprefix("model."), {})[part] = tensor
        else:
            rest.append((name, tensor))
    replaced = 0
    for module_name, linear in list(model.named_modules()):
        if not isinstance(linear, nn.Linear):
            continue
        parent, _, child = module_name.rpartition(".")
        pieces = [f"{parent}.{p}" if parent else p for p in packed_modules.get(child, (child,))]
        if not all(p in quantized for p in pieces):
            if any(p in quantized for p in pieces):
                raise ValueError(f"{module_name}: the checkpoint quantizes only some of {pieces}")
            continue  # a float layer (the LM head, usually)
        parts = []
        for p in pieces:
            t = quantized.pop(p)
            if fmt.method == "compressed-tensors":
                parts.append(repack_compressed(fmt, p, t))
                continue
            missing = [x for x in ("qweight", "qzeros", "scales") if x not in t]
            if missing:
                raise ValueError(f"{p}: the checkpoint lacks {', '.join(missing)}")
            parts.append(repack(fmt, p, t["qweight"], t["qzeros"], t["scales"], t.get("g_idx")))
        layout = _concat(parts)
        if layout.qweight.shape[0] != linear.out_features or layout.in_features != linear.in_features:
            raise ValueError(f"{module_name}: the checkpoint's {layout.qweight.shape[0]}x{layout.in_features} "
                             f"does not fit {linear.out_features}x{linear.in_features}")
        device = linear.weight.device
        layout = Int4Weights(layout.qweight.to(device), layout.scales.to(device),
                             None if layout.zeros is None else layout.zeros.to(device),
                             layout.group_size, layout.in_features)
        new = Int4Linear(layout, linear.bias, linear.weight.dtype)  # the bias is loaded with the rest
        setattr(model.get_submodule(parent) if parent else model, child, new)
        replaced += 1
    if quantized:
        raise ValueError(f"quantized checkpoint layers with no place in the model: {sorted(quantized)[:3]}")
    return rest, replaced
