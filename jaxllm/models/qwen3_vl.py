"""Qwen3-VL's vision transformer in Flax (transformers' `Qwen3VLVisionModel` math) and the
host-side index arithmetic it takes.

Against Qwen2.5-VL's tower (jaxllm/models/qwen2_5_vl.py): LayerNorms with biases instead of
RMSNorms, an ungated MLP, no window attention (every block attends over the whole image),
learned position embeddings bilinearly resampled to each image's patch grid, and **deepstack**:
the hidden states after each of `deepstack_visual_indexes`' blocks go through a merger of their
own (LayerNorm after the 2x2 shuffle), and the language model adds each level's features to the
image tokens' hidden states after its first decoder layers (`Decoder.__call__`). The tower
returns the main embeddings and every deepstack level side by side, [N / U, (1 + L) * out], so
the encoder cache and the step's image rows carry them together (`mm_embed_width`).

As Qwen2.5-VL's, the tower runs over a bucket of N patches; the grid-dependent inputs (rotary
positions, the image each patch belongs to, the position-embedding taps and weights) are
computed on the host in NumPy (`vision_inputs`), so one program serves any images whose patches
fit the bucket. What the config says: jaxllm/models/qwen3_vl_spec.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.layers.backends.reference import ACTIVATIONS
from jaxllm.models.params import constant, dummy_weight
from jaxllm.models.qwen3_vl_spec import Qwen3VLVisionSpec

_EPS = 1e-6  # the tower's LayerNorms (transformers hard-codes it)


class VisionInputs(NamedTuple):
    """The grid-dependent inputs of one tower call over N padded patches."""
    rope_pos: np.ndarray      # int32 [N, 2]: each patch's (row, column) in its image's grid
    image_seg: np.ndarray     # int32 [N]: each patch's image (-1: padding)
    interp_index: np.ndarray  # int32 [N, 4]: the position-embedding rows bilinear reads
    interp_weight: np.ndarray  # float32 [N, 4]: their weights


def _taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear, align_corners=True taps and weights on one axis (transformers' float32
    arithmetic, clamped at the border)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    dist = np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32))
    return taps, np.clip(1 - dist, 0, None).astype(np.float32)


def vision_inputs(grids: list, spec: Qwen3VLVisionSpec, num_patches: int) -> VisionInputs:
    """The tower's inputs for images of `grids` [(t, h, w)...] padded to num_patches; patches
    in the image processor's order (2x2 merge blocks, row-major)."""
    m, side = spec.spatial_merge_size, spec.grid_side
    pos, seg, idx, wts = [], [], [], []
    for img, (t, h, w) in enumerate(grids):
        t, h, w = int(t), int(h), int(w)
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // m, m, w // m, m)
        rows = np.tile(hh.reshape(block).transpose(0, 2, 1, 3).ravel(), t)
        cols = np.tile(ww.reshape(block).transpose(0, 2, 1, 3).ravel(), t)
        pos.append(np.stack([rows, cols], -1))
        seg.append(np.full(t * h * w, img))
        ht, hw_ = _taps(rows, h, side)
        wt, ww_ = _taps(cols, w, side)
        idx.append((ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4))
        wts.append((hw_[:, :, None] * ww_[:, None, :]).reshape(-1, 4))
    n = sum(len(s) for s in seg)
    if n > num_patches:
        raise ValueError(f"{n} image patches exceed the tower's bucket of {num_patches}")
    pad = num_patches - n
    return VisionInputs(
        np.concatenate(pos + [np.zeros((pad, 2), np.int64)]).astype(np.int32),
        np.concatenate(seg + [np.full(pad, -1)]).astype(np.int32),
        np.concatenate(idx + [np.zeros((pad, 4), np.int64)]).astype(np.int32),
        np.concatenate(wts + [np.zeros((pad, 4), np.float32)]).astype(np.float32))


def _layer_norm(x, w, b):
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), -1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + _EPS) * w + b).astype(x.dtype)


def _rotate(x, cos, sin):
    """transformers' rotate_half rotation over the whole head_dim, in float32."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return (xf * cos + jnp.concatenate([-x2, x1], -1) * sin).astype(x.dtype)


_BLOCK = ("norm1", "norm1_bias", "norm2", "norm2_bias", "qkv", "qkv_bias", "proj", "proj_bias",
          "fc1", "fc1_bias", "fc2", "fc2_bias")


class Qwen3VLTower(nnx.Module):
    """pixel patches [N, C·t·p·p] + `VisionInputs` -> [N / U, (1 + L) · out]: the merged image
    token embeddings, then each of the L deepstack levels' features. Weights replicated: the
    tower is a small share of the model."""

    def __init__(self, spec: Qwen3VLVisionSpec, seed: int, dtype):
        if spec.activation not in ACTIVATIONS:
            raise ConfigError(f"vision hidden_act {spec.activation!r} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")
        self.spec = spec
        L, E, F, K = spec.depth, spec.hidden_size, spec.intermediate_size, spec.patch_values
        M, O, D = E * spec.merge_unit, spec.out_hidden_size, len(spec.deepstack_visual_indexes)

        def w(name, *shape):
            return dummy_weight(seed, "visual/" + name, shape, (None,) * len(shape), dtype)

        def const(value, *shape):
            return constant(value, shape, (None,) * len(shape), dtype)

        self.patch_embed, self.patch_bias = w("patch_embed", K, E), w("patch_bias", E)
        self.pos_embed = w("pos_embed", spec.num_position_embeddings, E)
        self.norm1, self.norm1_bias = const(1.0, L, E), const(0.0, L, E)
        self.norm2, self.norm2_bias = const(1.0, L, E), const(0.0, L, E)
        self.qkv, self.qkv_bias = w("qkv", L, E, 3 * E), w("qkv_bias", L, 3 * E)
        self.proj, self.proj_bias = w("proj", L, E, E), w("proj_bias", L, E)
        self.fc1, self.fc1_bias = w("fc1", L, E, F), w("fc1_bias", L, F)
        self.fc2, self.fc2_bias = w("fc2", L, F, E), w("fc2_bias", L, E)
        self.merge_norm, self.merge_norm_bias = const(1.0, E), const(0.0, E)
        self.merge1, self.merge1_bias = w("merge1", M, M), w("merge1_bias", M)
        self.merge2, self.merge2_bias = w("merge2", M, O), w("merge2_bias", O)
        # deepstack mergers, stacked by level; their LayerNorm is over the shuffled M values
        self.ds_norm, self.ds_norm_bias = const(1.0, D, M), const(0.0, D, M)
        self.ds1, self.ds1_bias = w("ds1", D, M, M), w("ds1_bias", D, M)
        self.ds2, self.ds2_bias = w("ds2", D, M, O), w("ds2_bias", D, O)

    def _merge(self, x, norm, norm_b, w1, b1, w2, b2, post_shuffle: bool):
        M = self.spec.hidden_size * self.spec.merge_unit
        x = _layer_norm(x.reshape(-1, M), norm, norm_b) if post_shuffle \
            else _layer_norm(x, norm, norm_b).reshape(-1, M)
        return jax.nn.gelu(x @ w1 + b1, approximate=False) @ w2 + b2

    def __call__(self, patches: jax.Array, inp: VisionInputs) -> jax.Array:
        s = self.spec
        H, D = s.num_heads, s.head_dim
        dt = self.patch_embed.dtype
        x = patches.astype(dt) @ self.patch_embed[...] + self.patch_bias[...]
        N = x.shape[0]
        taps = self.pos_embed[...][jnp.asarray(inp.interp_index)]  # [N, 4, E]
        weight = jnp.asarray(inp.interp_weight)[:, :, None]
        x = x + (taps.astype(jnp.float32) * weight).sum(1).astype(dt)
        inv = 1.0 / (s.rope_theta ** (np.arange(0, D // 2, 2, dtype=np.float32) / (D // 2)))
        freqs = jnp.asarray(inp.rope_pos).astype(jnp.float32)[..., None] * inv
        freqs = jnp.concatenate([freqs[:, 0], freqs[:, 1]], -1)  # [N, D / 2]
        cos = jnp.tile(jnp.cos(freqs), 2)[:, None, :]
        sin = jnp.tile(jnp.sin(freqs), 2)[:, None, :]
        seg = jnp.asarray(inp.image_seg)
        mask = seg[:, None] == seg[None, :]
        act = ACTIVATIONS[s.activation]

        def block(x, p):
            h = _layer_norm(x, p["norm1"], p["norm1_bias"])
            q, k, v = jnp.split((h @ p["qkv"] + p["qkv_bias"]).reshape(N, 3 * H, D), 3, axis=1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            scores = jnp.einsum("qhd,khd->hqk", q, k) * (D ** -0.5)
            scores = jnp.where(mask[None], scores, -jnp.inf)
            probs = jax.nn.softmax(scores.astype(jnp.float32), -1).astype(dt)
            attn = jnp.einsum("hqk,khd->qhd", probs, v).reshape(N, H * D)
            x = x + attn @ p["proj"] + p["proj_bias"]
            h = _layer_norm(x, p["norm2"], p["norm2_bias"])
            return x + act(h @ p["fc1"] + p["fc1_bias"]) @ p["fc2"] + p["fc2_bias"], None

        weights = {k: getattr(self, k)[...] for k in _BLOCK}
        levels, start = [], 0
        # the blocks in runs that end at each deepstack block (static slices of the stack)
        for j, end in enumerate(s.deepstack_visual_indexes + (s.depth - 1,)):
            x, _ = jax.lax.scan(block, x, jax.tree.map(lambda a: a[start:end + 1], weights))
            start = end + 1
            if j < len(s.deepstack_visual_indexes):
                levels.append(self._merge(x, self.ds_norm[j], self.ds_norm_bias[j], self.ds1[j],
                                          self.ds1_bias[j], self.ds2[j], self.ds2_bias[j], True))
        main = self._merge(x, self.merge_norm[...], self.merge_norm_bias[...], self.merge1[...],
                           self.merge1_bias[...], self.merge2[...], self.merge2_bias[...], False)
        return jnp.concatenate([main] + levels, -1)


def vision_targets(spec: Qwen3VLVisionSpec) -> dict[str, tuple]:
    """Checkpoint tensor name -> (tower parameter, layer/level or None, host transform, rank)
    for every tensor of the tower, as `qwen2_5_vl.checkpoint_name` normalizes the names."""
    E = spec.hidden_size
    T = lambda x: x.T  # noqa: E731  [out, in] -> [in, out]
    same = lambda x: x  # noqa: E731
    v = "visual."
    out = {v + "patch_embed.proj.weight": ("patch_embed", None,
                                           lambda x: x.reshape(E, -1).T, 2),
           v + "patch_embed.proj.bias": ("patch_bias", None, same, 1),
           v + "pos_embed.weight": ("pos_embed", None, same, 2),
           v + "merger.norm.weight": ("merge_norm", None, same, 1),
           v + "merger.norm.bias": ("merge_norm_bias", None, same, 1),
           v + "merger.linear_fc1.weight": ("merge1", None, T, 2),
           v + "merger.linear_fc1.bias": ("merge1_bias", None, same, 1),
           v + "merger.linear_fc2.weight": ("merge2", None, T, 2),
           v + "merger.linear_fc2.bias": ("merge2_bias", None, same, 1)}
    for j in range(len(spec.deepstack_visual_indexes)):
        p = f"{v}deepstack_merger_list.{j}."
        for hf, name in (("norm.weight", "ds_norm"), ("norm.bias", "ds_norm_bias"),
                         ("linear_fc1.weight", "ds1"), ("linear_fc1.bias", "ds1_bias"),
                         ("linear_fc2.weight", "ds2"), ("linear_fc2.bias", "ds2_bias")):
            matrix = hf.startswith("linear") and hf.endswith(".weight")
            out[p + hf] = (name, j, T if matrix else same, 2 if matrix else 1)
    for i in range(spec.depth):
        for hf, name in (("norm1.weight", "norm1"), ("norm1.bias", "norm1_bias"),
                         ("norm2.weight", "norm2"), ("norm2.bias", "norm2_bias"),
                         ("attn.qkv.weight", "qkv"), ("attn.qkv.bias", "qkv_bias"),
                         ("attn.proj.weight", "proj"), ("attn.proj.bias", "proj_bias"),
                         ("mlp.linear_fc1.weight", "fc1"), ("mlp.linear_fc1.bias", "fc1_bias"),
                         ("mlp.linear_fc2.weight", "fc2"), ("mlp.linear_fc2.bias", "fc2_bias")):
            matrix = hf.endswith(".weight") and "norm" not in hf
            out[f"{v}blocks.{i}.{hf}"] = (name, i, T if matrix else same, 2 if matrix else 1)
    return out
