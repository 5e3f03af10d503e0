"""Quantized projection weights: how they are stored and what they mean.

A quantized projection keeps its values in a narrow dtype (int8, int4, float8_e4m3fn) in the
float weight's own layout ([in..., out...], input axes first; int4 values two to a uint8 along
the last axis, see `pack_int4`), with float32 scales (and, for
asymmetric integer schemes, zero points) laid out [groups, out...]: one group per output
channel spans the whole input (per-channel), or `group_size` consecutive inputs each. Every
checkpoint format is brought to this one form at load (a per-tensor scale is repeated over its
channels), so the backends see one kind of quantized weight.

The value is w = (q - zero) * scale, in float32, as compressed-tensors, AWQ and GPTQ define it.
MXFP4 (GPT-OSS's experts) is the one other form: e2m1 codes two a byte along the input axis
and uint8 e8m0 scales per 32 inputs (`pallas_kernels.grouped_matmul.mxfp4`); a uint8 scale
marks it (`is_mxfp4`).
The backends' `project` takes a `QuantizedWeight` wherever it takes a float weight.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.grouped_matmul import mxfp4

# int4 is stored packed in uint8 (`pack_int4`): XLA:CPU hands out int4 arrays unpacked while
# its compiled programs ask for them packed (jax 0.10), so an AOT-compiled step refuses them;
# packing by hand keeps 4 bits per value on every platform.
WEIGHT_DTYPES = {"int8": jnp.int8, "int4": jnp.uint8, "float8_e4m3fn": jnp.float8_e4m3fn,
                 "mxfp4": jnp.uint8}
# The largest value each storage dtype holds (symmetric integer schemes use [-max - 1, max]).
_MAX = {"int8": 127.0, "int4": 7.0, "float8_e4m3fn": 448.0}


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How a model's layer projections are quantized (hashable: part of `ModelConfig`).

    method: where it came from, as vLLM names it ('compressed-tensors', or an online method
    such as 'fp8'); weight_dtype: a key of WEIGHT_DTYPES; group_size: inputs per scale (None:
    one scale per output channel); symmetric: False when zero points are stored;
    activations: what the checkpoint says about activations ('none', 'dynamic', 'static'),
    reported at start-up: they are not quantized here (see docs/quantization.md);
    checkpoint_format: compressed-tensors' `format` (None for an online method);
    experts_only: only the stacked MoE experts are quantized, the other projections are float
    (MXFP4 checkpoints)."""
    method: str
    weight_dtype: str
    group_size: Optional[int] = None
    symmetric: bool = True
    activations: str = "none"
    checkpoint_format: Optional[str] = None  # how the checkpoint stores them (the loader's)
    experts_only: bool = False

    @property
    def storage_dtype(self):
        return WEIGHT_DTYPES[self.weight_dtype]

    def groups(self, inputs: int) -> int:
        """Scale rows of a projection with `inputs` inputs."""
        if self.group_size is None:
            return 1
        if inputs % self.group_size:
            raise ValueError(f"{inputs} inputs do not divide into groups of {self.group_size}")
        return inputs // self.group_size

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per-channel"
        sym = "symmetric" if self.symmetric else "asymmetric"
        acts = ("" if self.activations == "none" else
                f"; the checkpoint's {self.activations} activation quantization is not applied "
                "(activations stay in the model's dtype)")
        which = "expert weights" if self.experts_only else "weights"
        return f"{self.method}: {self.weight_dtype} {which}, {group}, {sym}{acts}"


class QuantizedWeight(NamedTuple):
    """A projection's quantized values q [in..., out...], scale [groups, out...] (float32)
    and zero [groups, out...] (float32; None when symmetric). A pytree: it slices in the layer
    scan as the float weights do. MXFP4: q uint8 [in / 2, out...] (e2m1 codes, two a byte
    along the input axis), scale uint8 [in / 32, out...] (e8m0), no zero."""
    q: jax.Array
    scale: jax.Array
    zero: Optional[jax.Array] = None


def is_mxfp4(w) -> bool:
    """Whether w is an MXFP4 `QuantizedWeight` (its scales are e8m0 bytes)."""
    return isinstance(w, QuantizedWeight) and w.scale.dtype == jnp.uint8


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int4 values (any integer dtype, in [-8, 7]) [..., n] -> uint8 [..., n / 2]: value 2i in
    the low nibble of byte i, 2i + 1 in the high one, each stored plus 8."""
    u = (np.asarray(q).astype(np.int16) + 8).astype(np.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: jax.Array) -> jax.Array:
    """`pack_int4` undone on device: uint8 [..., n / 2] -> float32 [..., n]."""
    lo = (p & 15).astype(jnp.float32) - 8.0
    hi = (p >> 4).astype(jnp.float32) - 8.0
    return jnp.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def dequantize(w: QuantizedWeight, inputs: int, n: int, dtype) -> jax.Array:
    """The weight as a float [inputs, n] matrix in dtype: (q - zero) * scale in float32
    (MXFP4: e2m1(q) * 2 ** (scale - 127))."""
    if is_mxfp4(w):
        return mxfp4.dequantize(w.q.reshape(inputs // 2, n),
                                w.scale.reshape(inputs // mxfp4.GROUP, n), dtype)
    groups = w.scale.size // n
    q = unpack_int4(w.q) if w.q.dtype == jnp.uint8 else w.q
    q = q.reshape(groups, inputs // groups, n).astype(jnp.float32)
    if w.zero is not None:
        q = q - w.zero.reshape(groups, 1, n)
    return (q * w.scale.reshape(groups, 1, n)).astype(dtype).reshape(inputs, n)


def dequantize_experts(w: QuantizedWeight, inputs: int, n: int, dtype) -> jax.Array:
    """Stacked experts' weights [X, in..., out...] (scales [X, groups, out...]) as float
    [X, inputs, n] matrices in dtype."""
    return jax.vmap(lambda w: dequantize(w, inputs, n, dtype))(w)


def quantize_rows(x: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric min-max quantization of a float [out, in] matrix on the host (the online
    methods): (q [out, in] in the storage dtype, scale [out, groups] float32)."""
    out, inputs = x.shape
    g = spec.groups(inputs)
    xf = np.asarray(x, np.float32).reshape(out, g, inputs // g)
    amax = np.abs(xf).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / _MAX[spec.weight_dtype], 1.0).astype(np.float32)
    y = xf / scale
    if spec.weight_dtype == "float8_e4m3fn":
        q = np.clip(y, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    else:
        top = _MAX[spec.weight_dtype]
        q = np.clip(np.round(y), -top - 1, top).astype(np.int8)
    return q.reshape(out, inputs), scale.reshape(out, g)
