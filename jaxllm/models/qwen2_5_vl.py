"""Qwen2.5-VL's vision transformer in Flax, and the host-side index arithmetic around it: the
per-image window order, the attention segments, and the language model's M-RoPE positions.

The tower runs over a bucket of N patches (all the images of a step, concatenated; the tail
padding). Everything that depends on the images' grids is computed here on the host in NumPy
(`vision_inputs`) and passed as int32 arrays, so one program serves any images whose patches
fit the bucket. Attention is dense over the bucket with a segment mask (a patch attends to the
patches of its own window, or its own image in the full-attention blocks), which is what
transformers' per-window split computes.
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
from jaxllm.models.vision_spec import VisionSpec

_EPS = 1e-6  # the tower's RMSNorms (transformers hard-codes it)


class VisionInputs(NamedTuple):
    """The grid-dependent indices of one tower call over N padded patches (int32)."""
    rope_pos: np.ndarray      # [N, 2]: each patch's (row, column) in its image's patch grid
    window_index: np.ndarray  # [N / U]: merge units in window order (U = merge_size ** 2)
    reverse_index: np.ndarray  # [N / U]: its inverse (back to the images' order)
    window_seg: np.ndarray    # [N]: each window-ordered patch's window (-1: padding)
    image_seg: np.ndarray     # [N]: each window-ordered patch's image (-1: padding)


def num_image_tokens(grid_thw, spec: VisionSpec) -> int:
    """Language-model tokens of one image: its merged patches."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // spec.merge_unit


def vision_inputs(grids: list, spec: VisionSpec, num_patches: int) -> VisionInputs:
    """The tower's index inputs for images of `grids` [(t, h, w)...] padded to num_patches."""
    m, U = spec.spatial_merge_size, spec.merge_unit
    win = spec.window_size // m // spec.patch_size  # window side, in merge units
    pos, order, win_seg, img_seg = [], [], [], []
    unit0, n_win = 0, 0
    for img, (t, h, w) in enumerate(grids):
        t, h, w = int(t), int(h), int(w)
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // m, m, w // m, m)
        hw = np.stack([hh.reshape(block).transpose(0, 2, 1, 3).ravel(),
                       ww.reshape(block).transpose(0, 2, 1, 3).ravel()], -1)
        pos.append(np.tile(hw, (t, 1)))
        gh, gw = h // m, w // m
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = -gh % win, -gw % win  # pad to whole windows (transformers pads one more
        # window when already whole; empty windows change nothing)
        padded = np.pad(index, ((0, 0), (0, ph), (0, pw)), constant_values=-1)
        nh, nw = (gh + ph) // win, (gw + pw) // win
        padded = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(t, -1,
                                                                                     win * win)
        for window in padded.reshape(-1, win * win):
            units = window[window >= 0]
            if len(units):
                order.append(units + unit0)
                win_seg.append(np.full(len(units) * U, n_win))
                n_win += 1
        img_seg.append(np.full(t * h * w, img))
        unit0 += t * gh * gw
    n = unit0 * U
    if n > num_patches:
        raise ValueError(f"{n} image patches exceed the tower's bucket of {num_patches}")
    pad_units = (num_patches - n) // U
    order = np.concatenate(order + [np.arange(unit0, unit0 + pad_units)])
    rope_pos = np.concatenate(pos + [np.zeros((num_patches - n, 2), np.int64)])
    pad = np.full(num_patches - n, -1)
    return VisionInputs(rope_pos.astype(np.int32), order.astype(np.int32),
                        np.argsort(order).astype(np.int32),
                        np.concatenate(win_seg + [pad]).astype(np.int32),
                        np.concatenate(img_seg + [pad]).astype(np.int32))


def mrope_positions(token_ids, grids: list, spec: VisionSpec) -> tuple[np.ndarray, int]:
    """(positions int32 [3, P], delta) of a prompt, as transformers' `get_rope_index`: text
    tokens count on one position on all three axes; an image's tokens take (t, row, column)
    offsets from the position where it starts, and the text after it continues from that
    start plus the larger of its merged height and width. Generated tokens are at index + delta
    on all three axes."""
    ids = np.asarray(token_ids)
    is_img = ids == spec.image_token_id
    m = spec.spatial_merge_size
    out = np.zeros((3, len(ids)), np.int64)
    i, cur, images = 0, 0, iter(grids)
    while i < len(ids):
        if not is_img[i]:
            j = i
            while j < len(ids) and not is_img[j]:
                j += 1
            out[:, i:j] = np.arange(cur, cur + j - i)
            cur += j - i
            i = j
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError("the prompt has more image placeholder tokens than images")
        t, h, w = int(grid[0]), int(grid[1]) // m, int(grid[2]) // m
        n = t * h * w
        if not is_img[i:i + n].all() or i + n > len(ids):
            raise ValueError(f"an image of {n} tokens has fewer placeholder tokens in the prompt")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, i:i + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
        cur += max(h, w)
        i += n
    if next(images, None) is not None:
        raise ValueError("the prompt has fewer image placeholder tokens than images")
    delta = int(out.max()) + 1 - len(ids) if len(ids) else 0
    return out.astype(np.int32), delta


def _rms(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + _EPS)
    return w * y.astype(x.dtype)


def _rotate(x, cos, sin):
    """transformers' rotate_half rotation over the whole head_dim, in float32."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return (xf * cos + jnp.concatenate([-x2, x1], -1) * sin).astype(x.dtype)


class VisionTower(nnx.Module):
    """pixel patches [N, C·t·p·p] + `VisionInputs` -> image token embeddings [N / U, out],
    in the images' order (U patches merge into one token). Weights replicated: the tower is a
    small share of the model."""

    def __init__(self, spec: VisionSpec, seed: int, dtype):
        if spec.activation not in ACTIVATIONS:
            raise ConfigError(f"vision hidden_act {spec.activation!r} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")
        self.spec = spec
        L, E, F, K = spec.depth, spec.hidden_size, spec.intermediate_size, spec.patch_values
        M, O = E * spec.merge_unit, spec.out_hidden_size

        def w(name, *shape):
            return dummy_weight(seed, "visual/" + name, shape, (None,) * len(shape), dtype)

        def one(*shape):
            return constant(1.0, shape, (None,) * len(shape), dtype)

        self.patch_embed = w("patch_embed", K, E)
        self.norm1, self.norm2 = one(L, E), one(L, E)
        self.qkv, self.qkv_bias = w("qkv", L, E, 3 * E), w("qkv_bias", L, 3 * E)
        self.proj, self.proj_bias = w("proj", L, E, E), w("proj_bias", L, E)
        self.gate, self.gate_bias = w("gate", L, E, F), w("gate_bias", L, F)
        self.up, self.up_bias = w("up", L, E, F), w("up_bias", L, F)
        self.down, self.down_bias = w("down", L, F, E), w("down_bias", L, E)
        self.ln_q = one(E)
        self.merge1, self.merge1_bias = w("merge1", M, M), w("merge1_bias", M)
        self.merge2, self.merge2_bias = w("merge2", M, O), w("merge2_bias", O)

    def __call__(self, patches: jax.Array, inp: VisionInputs) -> jax.Array:
        s = self.spec
        U, H, D = s.merge_unit, s.num_heads, s.head_dim
        dt = self.patch_embed.dtype
        x = patches.astype(dt) @ self.patch_embed[...]
        N = x.shape[0]
        perm = (jnp.asarray(inp.window_index)[:, None] * U + jnp.arange(U)).reshape(-1)
        x = x[perm]
        inv = 1.0 / (s.rope_theta ** (np.arange(0, D // 2, 2, dtype=np.float32) / (D // 2)))
        freqs = jnp.asarray(inp.rope_pos)[perm].astype(jnp.float32)[..., None] * inv
        freqs = jnp.concatenate([freqs[:, 0], freqs[:, 1]], -1)  # [N, D / 2]
        cos = jnp.tile(jnp.cos(freqs), 2)[:, None, :]
        sin = jnp.tile(jnp.sin(freqs), 2)[:, None, :]
        ws, iseg = jnp.asarray(inp.window_seg), jnp.asarray(inp.image_seg)
        masks = jnp.stack([ws[:, None] == ws[None, :], iseg[:, None] == iseg[None, :]])
        full = jnp.asarray([i in s.fullatt_block_indexes for i in range(s.depth)], jnp.int32)
        act = ACTIVATIONS[s.activation]
        weights = {k: getattr(self, k)[...] for k in (
            "norm1", "norm2", "qkv", "qkv_bias", "proj", "proj_bias", "gate", "gate_bias",
            "up", "up_bias", "down", "down_bias")}

        def block(x, layer):
            p, is_full = layer
            h = _rms(x, p["norm1"])
            q, k, v = jnp.split((h @ p["qkv"] + p["qkv_bias"]).reshape(N, 3 * H, D), 3, axis=1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            scores = jnp.einsum("qhd,khd->hqk", q, k) * (D ** -0.5)
            scores = jnp.where(masks[is_full][None], scores, -jnp.inf)
            probs = jax.nn.softmax(scores.astype(jnp.float32), -1).astype(dt)
            attn = jnp.einsum("hqk,khd->qhd", probs, v).reshape(N, H * D)
            x = x + attn @ p["proj"] + p["proj_bias"]
            h = _rms(x, p["norm2"])
            h = act(h @ p["gate"] + p["gate_bias"]) * (h @ p["up"] + p["up_bias"])
            return x + h @ p["down"] + p["down_bias"], None

        x, _ = jax.lax.scan(block, x, (weights, full))
        x = _rms(x, self.ln_q[...]).reshape(N // U, U * s.hidden_size)
        x = jax.nn.gelu(x @ self.merge1[...] + self.merge1_bias[...], approximate=False)
        x = x @ self.merge2[...] + self.merge2_bias[...]
        return x[jnp.asarray(inp.reverse_index)]


def vision_targets(spec: VisionSpec) -> dict[str, tuple]:
    """Checkpoint tensor name -> (tower parameter, layer or None, host transform, rank) for
    every tensor of the tower (visual.*, as Qwen2.5-VL checkpoints name them)."""
    E = spec.hidden_size
    T = lambda x: x.T  # noqa: E731  [out, in] -> [in, out]
    same = lambda x: x  # noqa: E731
    out = {"visual.patch_embed.proj.weight": ("patch_embed", None,
                                              lambda x: x.reshape(E, -1).T, 2),
           "visual.merger.ln_q.weight": ("ln_q", None, same, 1),
           "visual.merger.mlp.0.weight": ("merge1", None, T, 2),
           "visual.merger.mlp.0.bias": ("merge1_bias", None, same, 1),
           "visual.merger.mlp.2.weight": ("merge2", None, T, 2),
           "visual.merger.mlp.2.bias": ("merge2_bias", None, same, 1)}
    for i in range(spec.depth):
        for hf, name in (("norm1.weight", "norm1"), ("norm2.weight", "norm2"),
                         ("attn.qkv.weight", "qkv"), ("attn.qkv.bias", "qkv_bias"),
                         ("attn.proj.weight", "proj"), ("attn.proj.bias", "proj_bias"),
                         ("mlp.gate_proj.weight", "gate"), ("mlp.gate_proj.bias", "gate_bias"),
                         ("mlp.up_proj.weight", "up"), ("mlp.up_proj.bias", "up_bias"),
                         ("mlp.down_proj.weight", "down"), ("mlp.down_proj.bias", "down_bias")):
            matrix = hf.endswith(".weight") and "norm" not in hf
            out[f"visual.blocks.{i}.{hf}"] = (name, i, T if matrix else same, 2 if matrix else 1)
    return out


def checkpoint_name(name: str) -> str:
    """A Qwen2.5-VL tensor name as `vision_targets` and the text model's targets spell it
    (transformers 5 may write model.language_model.* and model.visual.*)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name
