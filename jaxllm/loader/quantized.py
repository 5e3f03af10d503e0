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

# The quantized projections of a layer group: (the first of their input axes, how many) in
# the float layout ([L, in..., out...]; stacked experts [L, X, in..., out...]).
QUANT_INPUT_AXES = {"qkv": (1, 1), "o": (1, 3), "gate_up": (1, 1), "down": (1, 1),
                    "experts_gate_up": (2, 1), "experts_down": (2, 1)}


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


class _Projection:
    """One float projection target `t` as the quantized parameters it becomes: makers of the
    targets of its values, scales and zero points from checkpoint tensors already brought to
    the [out, in] / [out, groups] orientation of a float weight."""

    def __init__(self, t: Target, spec: QuantSpec, kv_heads_dim):
        proj = t.param[-1]
        self.t, self.spec = t, spec
        self.rows, self.inputs = t.shape
        self.groups = spec.groups(self.inputs)
        self.bits = 4 if spec.weight_dtype == "int4" else 8
        first, n_in = QUANT_INPUT_AXES[proj]
        self._scale_param = t.param[:-1] + (f"{proj}_scale",)
        self._zero_param = t.param[:-1] + (f"{proj}_zero",)
        self._scale_start = tuple(t.start[:first]) + (0,) + tuple(t.start[first + n_in:])
        self._to_scale = _scale_layout(proj, kv_heads_dim)

    def values(self, shape, to_oi: Callable) -> Target:
        """The values: to_oi(tensor) -> signed integers (or float8) [out, in]."""
        t = self.t
        if self.spec.weight_dtype == "int4":  # two a byte along the last axis
            return Target(t.param, t.start, shape, lambda x: pack_int4(t.to_block(to_oi(x))),
                          self.spec.storage_dtype)
        return Target(t.param, t.start, shape, lambda x: t.to_block(to_oi(x)),
                      self.spec.storage_dtype)

    def _per_group(self, x) -> np.ndarray:  # per tensor ([1] or []): repeated over channels
        x = np.asarray(x, np.float32)
        return (np.full((self.rows, self.groups), x.reshape(())) if x.size == 1
                else x.reshape(self.rows, self.groups))

    def scale(self, shape, to_og: Callable = lambda x: x) -> Target:
        """The scales: to_og(tensor) -> [out, groups] (or one per tensor)."""
        return Target(self._scale_param, self._scale_start, shape,
                      lambda x: self._to_scale(self._per_group(to_og(x))), np.float32)

    def zero(self, shape, to_og: Callable) -> Target:
        """The zero points, signed as the values are: to_og(tensor) -> [out, groups]."""
        return Target(self._zero_param, self._scale_start, shape,
                      lambda x: self._to_scale(self._per_group(to_og(x))), np.float32)


def _projection_targets(t: Target, spec: QuantSpec, kv_heads_dim) -> dict[str, list[Target]]:
    p = _Projection(t, spec, kv_heads_dim)
    if spec.method == "gguf":  # blocks decoded to values, scales, zeros (gguf_quant.decode)
        found = {".weight": p.values(t.shape, lambda x: x),
                 ".weight_scale": p.scale((p.rows, p.groups))}
        if not spec.symmetric:
            found[".weight_zero"] = p.zero((p.rows, p.groups), lambda x: x)
        return {k: [v] for k, v in found.items()}
    if spec.method in ("gptq", "awq"):
        return {k: [v] for k, v in (_gptq if spec.method == "gptq" else _awq)(p).items()}
    if spec.method != "compressed-tensors":  # online: quantize the float weight here
        quantize = _last(lambda x: quantize_rows(x, spec))
        return {".weight": [p.values(t.shape, lambda x: quantize(x)[0]),
                            p.scale(t.shape, lambda x: quantize(x)[1])]}
    return {k: [v] for k, v in _compressed_tensors(p).items()}


def _compressed_tensors(p: _Projection) -> dict[str, Target]:
    spec, bits, rows, inputs = p.spec, p.bits, p.rows, p.inputs
    found = {".weight_scale": p.scale(None)}
    if spec.activations == "static":
        found[".input_scale"] = Target(None, (), None, lambda x: x)
    if _packed(spec):
        found[".weight_packed"] = p.values((rows, inputs * bits // 32),
                                           lambda x: unpack(x, bits, inputs))
        found[".weight_shape"] = Target(None, (), (2,), _expect_shape((rows, inputs)))
    else:
        found[".weight"] = p.values((rows, inputs), lambda x: x)
    if not spec.symmetric:
        found[".weight_zero_point"] = p.zero(None, (lambda x: unpack(x.T, bits, rows).T)
                                             if _packed(spec) else (lambda x: x))
    return found


def _gptq(p: _Projection) -> dict[str, Target]:
    """qweight [in * bits / 32, out], qzeros [groups, out * bits / 32] (v1: stored minus
    one), scales [groups, out], g_idx [in]; symmetric checkpoints' zero points must be the
    midpoint, and are then not kept."""
    bits, rows, inputs, groups = p.bits, p.rows, p.inputs, p.groups
    offset = 1 if p.spec.checkpoint_format == "gptq" else 0
    zeros = lambda x: (unpack(x, bits, rows) + offset).T  # noqa: E731  signed [out, groups]
    found = {".qweight": p.values((inputs * bits // 32, rows),
                                  lambda x: unpack(x.T, bits, inputs)),
             ".scales": p.scale((groups, rows), lambda x: x.T),
             ".g_idx": Target(None, (), (inputs,),
                              _expect_values(np.arange(inputs) // (inputs // groups), "g_idx"))}
    zshape = (groups, rows * bits // 32)
    found[".qzeros"] = (p.zero(zshape, zeros) if not p.spec.symmetric else
                        Target(None, (), zshape,
                               lambda x: _expect_values(0, "symmetric qzeros")(zeros(x))))
    return found


# AutoAWQ packs the 8 nibbles of a word from columns 0, 2, 4, 6, 1, 3, 5, 7: column c of a
# word is nibble _AWQ_NIBBLE[c].
_AWQ_NIBBLE = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def _awq(p: _Projection) -> dict[str, Target]:
    """qweight [in, out / 8], qzeros [groups, out / 8] (both in AWQ's nibble order), scales
    [groups, out]."""
    rows, inputs, groups = p.rows, p.inputs, p.groups

    def columns(x):  # [r, out / 8] words -> signed [r, out] in column order
        v = unpack(x, 4, rows).reshape(x.shape[0], -1, 8)
        return v[:, :, _AWQ_NIBBLE].reshape(x.shape[0], rows)

    return {".qweight": p.values((inputs, rows // 8), lambda x: columns(x).T),
            ".qzeros": p.zero((groups, rows // 8), lambda x: columns(x).T),
            ".scales": p.scale((groups, rows), lambda x: x.T)}


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


def _expect_values(expected, name: str) -> Callable:
    """A check that a tensor holds what the format implies for what is supported (it is then
    not kept)."""
    def check(x):
        if not np.array_equal(np.asarray(x), np.broadcast_to(expected, np.shape(x))):
            raise ValueError(f"{name} is not what this checkpoint's quantization_config implies "
                             "(activation order or per-group zero points?)")
        return x
    return check


def _expect_shape(shape: tuple[int, int]) -> Callable:
    def check(x):
        if tuple(int(v) for v in np.asarray(x).reshape(-1)) != shape:
            raise ValueError(f"weight_shape {np.asarray(x).tolist()} is not {list(shape)}")
        return x
    return check


def _scale_layout(proj: str, kv_heads_dim) -> Callable[[np.ndarray], np.ndarray]:
    """[out, groups] scales -> the parameter's block [1, (1,) groups, out...] (the
    projection's output axes, as its float weight lays them out)."""
    K, D = kv_heads_dim
    if proj == "qkv":  # [K * n * D, g] -> [g, K, n, D]
        return lambda x: x.reshape(K, -1, D, x.shape[-1]).transpose(3, 0, 1, 2)[None]
    if proj == "gate_up":  # [F, g] -> [g, 1, F]
        return lambda x: x.T[:, None, :][None]
    if proj == "experts_gate_up":  # [F, g] -> [1 (expert), g, 1, F]
        return lambda x: x.T[:, None, :][None, None]
    if proj == "experts_down":  # [E, g] -> [1 (expert), g, E]
        return lambda x: x.T[None, None]
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
