"""A quantized model's checkpoint tensors -> its quantized projections (`QuantizedWeight`'s
layout: values in the float weight's layout, scales and zero points [groups, out...]).

compressed-tensors (llm-compressor) writes per projection, beside the float names:
  int-/float-/naive-quantized  `weight` (int8 or float8_e4m3fn [out, in])
  pack-quantized               `weight_packed` (int32 [out, in * bits / 32]: values + 2^(bits-1),
                               little end first) and `weight_shape` ([out, in])
                               (int4 values are repacked two a byte: `pack_int4`)
  both                         `weight_scale` ([out, groups]; [out, 1] per channel; [1] or []
                               per tensor), `weight_zero_point` when asymmetric (pack-quantized:
                               packed along the output axis), `input_scale` for static
                               activation schemes (read and not used: activations are not
                               quantized here).
An online method (--quantization fp8) quantizes each float projection as it is read.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from jaxllm.layers.quantization import QuantSpec, pack_int4, quantize_rows

# The quantized projections of a layer group and the number of their input axes (after the
# layer axis) in the float layout.
QUANT_INPUT_AXES = {"qkv": 1, "o": 3, "gate_up": 1, "down": 1}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `param[start:start + block.shape] = to_block(tensor)`,
    the tensor cast to `dtype` first (None: the model's dtype). param None: a tensor read and
    not used (named in the module docstring)."""
    param: Optional[tuple]   # path of the parameter in the model state
    start: tuple[int, ...]
    shape: Optional[tuple[int, ...]]  # the tensor's expected shape (None: not checked)
    to_block: Callable[[np.ndarray], np.ndarray]
    dtype: object = None


def quantized_targets(targets: dict[str, list[Target]], spec: QuantSpec,
                      kv_heads_dim: tuple[int, int]) -> dict[str, list[Target]]:
    """The float model's targets with each layer projection's `.weight` replaced by the
    tensors of `spec`'s format. kv_heads_dim: (KV heads, head dim), which lay out a fused QKV
    projection's output channels."""
    out: dict[str, list[Target]] = {}
    for name, ts in targets.items():
        t = ts[0]
        if not (t.param and t.param[-1] in QUANT_INPUT_AXES and name.endswith(".weight")):
            out[name] = ts
            continue
        base = name[:-len(".weight")]
        for suffix, more in _projection_targets(t, spec, kv_heads_dim).items():
            out.setdefault(base + suffix, []).extend(more)
    return out


def _projection_targets(t: Target, spec: QuantSpec, kv_heads_dim) -> dict[str, list[Target]]:
    proj = t.param[-1]
    rows, inputs = t.shape
    groups = spec.groups(inputs)
    n_in = QUANT_INPUT_AXES[proj]
    scale_param = t.param[:-1] + (f"{proj}_scale",)
    scale_start = (t.start[0], 0) + tuple(t.start[1 + n_in:])
    to_scale = _scale_layout(proj, kv_heads_dim)
    storage = spec.storage_dtype
    if spec.weight_dtype == "int4":  # int8 values -> two a byte along the last axis
        layout = lambda x: pack_int4(t.to_block(x))  # noqa: E731
    else:
        layout = t.to_block

    if spec.method != "compressed-tensors":  # online: quantize the float weight here
        quantize = _last(lambda x: quantize_rows(x, spec))
        return {".weight": [Target(t.param, t.start, t.shape,
                                   lambda x: t.to_block(quantize(x)[0]), storage),
                            Target(scale_param, scale_start, t.shape,
                                   lambda x: to_scale(quantize(x)[1]), np.float32)]}

    def scales(x):  # per tensor ([1] or []): repeated over the channels
        x = np.asarray(x, np.float32)
        return np.full((rows, groups), x.reshape(())) if x.size == 1 else x.reshape(rows, groups)

    found = {".weight_scale": Target(scale_param, scale_start, None,
                                     lambda x: to_scale(scales(x)), np.float32)}
    if spec.activations == "static":
        found[".input_scale"] = Target(None, (), None, lambda x: x)
    bits = 4 if spec.weight_dtype == "int4" else 8
    if _packed(spec):
        found[".weight_packed"] = Target(t.param, t.start, (rows, inputs * bits // 32),
                                         lambda x: layout(unpack(x, bits, inputs)), storage)
        found[".weight_shape"] = Target(None, (), (2,), _expect_shape((rows, inputs)))
    else:
        found[".weight"] = Target(t.param, t.start, t.shape, layout, storage)
    if not spec.symmetric:
        zero_param = t.param[:-1] + (f"{proj}_zero",)
        unpack_zero = ((lambda x: unpack(x.T, bits, rows).T) if _packed(spec)
                       else (lambda x: x))
        found[".weight_zero_point"] = Target(
            zero_param, scale_start, None,
            lambda x: to_scale(scales(unpack_zero(x))), np.float32)
    return {k: [v] for k, v in found.items()}


def _packed(spec: QuantSpec) -> bool:
    return spec.checkpoint_format == "pack-quantized"


def unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """compressed-tensors' int32 packing undone along the last axis: 32 / bits values per
    word, the first in the lowest bits, each stored plus 2^(bits - 1) -> signed int8 [..., count]."""
    per = 32 // bits
    words = np.asarray(packed).astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(per, dtype=np.int64) * bits
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*words.shape[:-1], -1)[..., :count]
    return (values - (1 << (bits - 1))).astype(np.int8)


def _expect_shape(shape: tuple[int, int]) -> Callable:
    def check(x):
        if tuple(int(v) for v in np.asarray(x).reshape(-1)) != shape:
            raise ValueError(f"weight_shape {np.asarray(x).tolist()} is not {list(shape)}")
        return x
    return check


def _scale_layout(proj: str, kv_heads_dim) -> Callable[[np.ndarray], np.ndarray]:
    """[out, groups] scales -> the parameter's block [1, groups, out...] (the projection's
    output axes, as its float weight lays them out)."""
    K, D = kv_heads_dim
    if proj == "qkv":  # [K * n * D, g] -> [g, K, n, D]
        return lambda x: x.reshape(K, -1, D, x.shape[-1]).transpose(3, 0, 1, 2)[None]
    if proj == "gate_up":  # [F, g] -> [g, 1, F]
        return lambda x: x.T[:, None, :][None]
    return lambda x: x.T[None]  # o, down: [E, g] -> [g, E]


def _last(f: Callable) -> Callable:
    """f memoized on its last argument (the same array handed to two targets in a row)."""
    memo: list = [None, None]

    def run(x):
        if memo[0] is not x:
            memo[0], memo[1] = x, f(x)
        return memo[1]
    return run


def storage_cast(x: np.ndarray, dtype) -> np.ndarray:
    """x in a parameter's dtype."""
    return x if x.dtype == dtype else x.astype(dtype)
