"""Rotary position embeddings: per-type inverse frequencies (NumPy, as transformers defines them)
and their application to q/k (JAX, neox layout: the two halves of head_dim rotate together).

Frequencies are computed in float32 like transformers, so the model matches it bit for bit in
the angles; they are trace-time constants, never parameters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One layer's RoPE settings (hashable, so the model stays a static jit argument)."""
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: Optional[float] = None  # yarn
    mscale: Optional[float] = None  # yarn
    mscale_all_dim: Optional[float] = None  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors within the original
    long_factor: tuple[float, ...] = ()   # longrope: ... and beyond it
    use_long: bool = False  # longrope: long factors (`for_max_model_len` decides)
    partial_rotary_factor: float = 1.0  # Phi-4-mini: only this leading fraction of head_dim
    rope_proportion: float = 1.0  # proportional (Gemma 4): the fraction of pairs that rotate

    @classmethod
    def from_hf(cls, params: dict, max_position_embeddings: int) -> "RopeSpec":
        """From a transformers rope dict (`rope_parameters` entry or legacy `rope_scaling`)."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first spelling
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"RoPE type {rope_type!r} is not supported (supported: "
                             f"{', '.join(ROPE_TYPES)})")
        partial = float(params.get("partial_rotary_factor") or 1.0)
        if not 0 < partial <= 1:
            raise ConfigError(f"partial_rotary_factor={partial} must be in (0, 1]")
        proportion = 1.0
        if rope_type == "proportional":  # its factor keeps the tables whole-head (below)
            partial, proportion = 1.0, partial
        factor = params.get("factor")
        if factor is None and rope_type == "longrope":  # as transformers: the extension ratio
            factor = max_position_embeddings / params["original_max_position_embeddings"]
        if factor is None and rope_type == "yarn":  # as transformers: the context extension
            factor = max_position_embeddings / params["original_max_position_embeddings"]
        orig = params.get("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn", "longrope") and orig is None:
            orig = max_position_embeddings
        return cls(
            rope_type=rope_type,
            theta=float(params.get("rope_theta", 10000.0)),
            factor=float(1.0 if factor is None else factor),
            original_max_position_embeddings=orig,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
            partial_rotary_factor=partial,
            rope_proportion=proportion,
        )

    def for_max_model_len(self, max_model_len: int) -> "RopeSpec":
        """LongRoPE picks its factors once per model, as vLLM does: the long ones when the
        engine may run sequences past original_max_position_embeddings. (transformers picks
        per forward call by the current length, so a sequence crossing that length has its
        earlier keys cached with the short factors; the two agree for models whose
        max_model_len stays within the original length, and for sequences that start past it.)"""
        if self.rope_type != "longrope":
            return self
        return dataclasses.replace(
            self, use_long=max_model_len > self.original_max_position_embeddings)


def _wavelength_factors(theta: float, dim: int) -> np.ndarray:
    """theta ** (2i / dim), float32 like transformers."""
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return np.power(np.float32(theta), exponent)


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return (np.float32(1.0) / _wavelength_factors(theta, dim)).astype(np.float32)


def inv_freq_and_scale(spec: RopeSpec, head_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies float32 [rotary dim // 2], cos/sin scale) for one RoPE spec (the
    rotary dim: head_dim times partial_rotary_factor)."""
    dim = int(head_dim * spec.partial_rotary_factor)
    t = spec.rope_type
    if t == "default":
        return _base_inv_freq(spec.theta, dim), 1.0
    if t == "linear":
        return (_base_inv_freq(spec.theta, dim) / np.float32(spec.factor)).astype(np.float32), 1.0
    if t == "dynamic":
        # vLLM's fixed NTK scaling: the base transformers would use once the sequence reaches
        # factor x max_position_embeddings. transformers instead recomputes the base from the
        # current length on every call (unscaled below max_position_embeddings), which a KV cache
        # cannot follow; the two agree for a sequence of exactly that length.
        f = spec.factor
        base = spec.theta * (f * f - (f - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if t == "llama3":
        inv = _base_inv_freq(spec.theta, dim)
        old = spec.original_max_position_embeddings
        low_wl, high_wl = old / spec.low_freq_factor, old / spec.high_freq_factor
        wavelen = (2 * math.pi / inv).astype(np.float32)
        scaled = np.where(wavelen > low_wl, inv / np.float32(spec.factor), inv).astype(np.float32)
        smooth = ((old / wavelen - spec.low_freq_factor)
                  / (spec.high_freq_factor - spec.low_freq_factor)).astype(np.float32)
        smoothed = (1 - smooth) * scaled / np.float32(spec.factor) + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if t == "yarn":
        return _yarn(spec, dim)
    if t == "longrope":
        return _longrope(spec, dim)
    if t == "proportional":  # transformers' _compute_proportional_rope_parameters
        return _proportional(spec, dim), 1.0
    raise ValueError(f"RoPE type {t!r} is not supported")


def _yarn(spec: RopeSpec, dim: int) -> tuple[np.ndarray, float]:
    f, base = spec.factor, spec.theta

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = spec.attention_factor
    if attn is None:
        attn = (mscale(f, spec.mscale) / mscale(f, spec.mscale_all_dim)
                if spec.mscale and spec.mscale_all_dim else mscale(f))

    def correction_dim(rotations):
        return (dim * math.log(spec.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = _wavelength_factors(base, dim)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(f) * pos_freqs)
    inv = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv.astype(np.float32), float(attn)


def _longrope(spec: RopeSpec, dim: int) -> tuple[np.ndarray, float]:
    ext = spec.long_factor if spec.use_long else spec.short_factor
    if len(ext) != dim // 2:
        raise ConfigError(f"longrope: {len(ext)} {'long' if spec.use_long else 'short'} "
                          f"factors for a rotary dim of {dim} (want {dim // 2})")
    attn, orig = spec.attention_factor, spec.original_max_position_embeddings
    if attn is None:  # the LongRoPE paper's, applied to short and long factors alike
        attn = 1.0 if spec.factor <= 1 else math.sqrt(1 + math.log(spec.factor) / math.log(orig))
    inv = np.float32(1.0) / (np.asarray(ext, np.float32) * _wavelength_factors(spec.theta, dim))
    return inv.astype(np.float32), float(attn)


def _proportional(spec: RopeSpec, dim: int) -> np.ndarray:
    """Gemma 4's full-attention RoPE: the first rope_proportion of the dim // 2 pairs rotate
    at theta ** (-2i / dim) (the whole head's exponents, not the rotated part's), the rest at
    frequency zero (cos 1, sin 0: unrotated), all divided by `factor`. Unlike
    partial_rotary_factor's leading channels, the rotated channels are the first ones of each
    rotate-half half."""
    angles = int(spec.rope_proportion * dim // 2)
    inv = np.zeros(dim // 2, np.float32)
    inv[:angles] = _base_inv_freq(spec.theta, dim)[:angles]
    return (inv / np.float32(spec.factor)).astype(np.float32)


def mrope_axes(section: tuple[int, ...]) -> np.ndarray:
    """Interleaved M-RoPE (Qwen3-VL, transformers' recomposition_frequencies): frequency j
    follows height where j % 3 == 1 and width where j % 3 == 2, within 3x each one's section
    size; the temporal position everywhere else."""
    j = np.arange(sum(section))
    return np.where((j % 3 == 1) & (j < 3 * section[1]), 1,
                    np.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))


def rope_tables(specs: tuple[RopeSpec, ...], head_dim: int, positions: jax.Array, dtype,
                mrope_section: tuple[int, ...] = (), mrope_interleaved: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """cos, sin [len(specs), T, head_dim // 2] in `dtype` for each distinct spec. M-RoPE
    (Qwen2.5-VL): positions [3, T] (temporal, height, width) and `mrope_section` the number of
    frequencies each axis drives, in that order; interleaved (Qwen3-VL) they take turns."""
    inv, scale = zip(*(inv_freq_and_scale(s, head_dim) for s in specs))
    if mrope_section:  # frequency j rotates by the position on its section's axis
        if positions.ndim == 1:  # text only: the same position on the three axes
            positions = jnp.broadcast_to(positions, (3, positions.shape[0]))
        axis = (mrope_axes(mrope_section) if mrope_interleaved
                else np.repeat(np.arange(3), mrope_section))
        pos = positions.astype(jnp.float32)[axis].T  # [T, head_dim // 2]
        freqs = pos[None] * jnp.asarray(np.stack(inv))[:, None, :]
    else:
        freqs = (positions.astype(jnp.float32)[None, :, None]
                 * jnp.asarray(np.stack(inv))[:, None, :])
    scale = jnp.asarray(scale, jnp.float32)[:, None, None]
    return (jnp.cos(freqs) * scale).astype(dtype), (jnp.sin(freqs) * scale).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, D] rotated by cos/sin [T, R // 2] (transformers' rotate_half layout) over its
    first R <= D channels; the rest pass (partial rotary embeddings)."""
    rot = 2 * cos.shape[-1]
    x, rest = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    x1, x2 = jnp.split(x, 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out if rest is None else jnp.concatenate([out, rest], axis=-1)
