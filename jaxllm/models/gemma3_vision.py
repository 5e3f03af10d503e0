"""Gemma 3's image encoder in Flax: the SigLIP vision transformer (transformers'
`SiglipVisionModel` math) and Gemma 3's multimodal projector, plus what the config says
about them (`Gemma3VisionSpec`, jaxllm/models/vision_spec.py).

An image is always the tower's fixed square (`image_size`, resized by the image processor), so
one program serves every image: pixels [B, C, S, S] -> `mm_tokens_per_image` embeddings per
image. The patch embedding is a Conv2d of stride = kernel, i.e. one matmul per patch; the
encoder is pre-LayerNorm with full (bidirectional) attention over the image's patches; the
projector average-pools the patch grid down to tokens_per_side², applies Gemma's RMSNorm
(scale 1 + w) and projects to the language model's width. The language model then attends
bidirectionally within each image's tokens (`AttentionMetadata.attend_to`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.layers.backends.reference import ACTIVATIONS
from jaxllm.models.params import constant, dummy_weight
from jaxllm.models.vision_spec import Gemma3VisionSpec


def _layer_norm(x, w, b, eps):
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), -1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


class SiglipTower(nnx.Module):
    """pixels [B, C, S, S] -> image token embeddings [B, mm_tokens_per_image, out]. Weights
    replicated: the tower is a small share of the model."""

    def __init__(self, spec: Gemma3VisionSpec, seed: int, dtype):
        if spec.activation not in ACTIVATIONS:
            raise ConfigError(f"vision hidden_act {spec.activation!r} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")
        self.spec = spec
        L, E, F, K = spec.depth, spec.hidden_size, spec.intermediate_size, spec.patch_values
        P = spec.patches_per_side ** 2

        def w(name, *shape):
            return dummy_weight(seed, "vision/" + name, shape, (None,) * len(shape), dtype)

        def const(value, *shape):
            return constant(value, shape, (None,) * len(shape), dtype)

        self.patch_embed, self.patch_bias = w("patch_embed", K, E), w("patch_bias", E)
        self.pos_embed = w("pos_embed", P, E)
        self.ln1, self.ln1_bias = const(1.0, L, E), const(0.0, L, E)
        self.ln2, self.ln2_bias = const(1.0, L, E), const(0.0, L, E)
        self.qkv, self.qkv_bias = w("qkv", L, E, 3 * E), w("qkv_bias", L, 3 * E)
        self.out, self.out_bias = w("out", L, E, E), w("out_bias", L, E)
        self.fc1, self.fc1_bias = w("fc1", L, E, F), w("fc1_bias", L, F)
        self.fc2, self.fc2_bias = w("fc2", L, F, E), w("fc2_bias", L, E)
        self.post_ln, self.post_ln_bias = const(1.0, E), const(0.0, E)
        self.soft_norm = const(0.0, E)  # Gemma RMSNorm: scale 1 + w
        self.projection = w("projection", E, spec.out_hidden_size)

    def __call__(self, pixels: jax.Array, inputs=None) -> jax.Array:
        s = self.spec
        B, p, n, H, D = pixels.shape[0], s.patch_size, s.patches_per_side, s.num_heads, s.head_dim
        dt = self.patch_embed.dtype
        # [B, C, n·p, n·p] -> [B, n·n patches, C·p·p] in the Conv2d weight's (C, p, p) order
        x = pixels.astype(dt).reshape(B, s.in_channels, n, p, n, p)
        x = x.transpose(0, 2, 4, 1, 3, 5).reshape(B, n * n, s.patch_values)
        x = x @ self.patch_embed[...] + self.patch_bias[...] + self.pos_embed[...]
        act = ACTIVATIONS[s.activation]
        eps = s.layer_norm_eps
        weights = {k: getattr(self, k)[...] for k in (
            "ln1", "ln1_bias", "ln2", "ln2_bias", "qkv", "qkv_bias", "out", "out_bias", "fc1",
            "fc1_bias", "fc2", "fc2_bias")}

        def block(x, w):
            h = _layer_norm(x, w["ln1"], w["ln1_bias"], eps)
            q, k, v = jnp.split((h @ w["qkv"] + w["qkv_bias"]).reshape(B, n * n, 3 * H, D), 3,
                                axis=2)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * D ** -0.5
            probs = jax.nn.softmax(scores, -1).astype(dt)
            attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, n * n, H * D)
            x = x + attn @ w["out"] + w["out_bias"]
            h = _layer_norm(x, w["ln2"], w["ln2_bias"], eps)
            return x + act(h @ w["fc1"] + w["fc1_bias"]) @ w["fc2"] + w["fc2_bias"], None

        x, _ = jax.lax.scan(block, x, weights)
        x = _layer_norm(x, self.post_ln[...], self.post_ln_bias[...], eps)
        t = s.tokens_per_side
        k = n // t  # average pool of k x k patches per token, in row-major token order
        x = x.reshape(B, t, k, t, k, -1).astype(jnp.float32).mean((2, 4)).reshape(B, t * t, -1)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
        x = x * (1.0 + self.soft_norm[...].astype(jnp.float32))
        return (x.astype(dt) @ self.projection[...]).astype(dt)


def vision_targets(spec: Gemma3VisionSpec) -> dict[str, tuple]:
    """Checkpoint tensor name -> (tower parameter, layer or None, host transform, rank), as
    `qwen2_5_vl.vision_targets`; names as `checkpoint_name` normalizes them. q, k and v are
    three tensors of the one fused qkv parameter (the transform places each in its third)."""
    E = spec.hidden_size
    T = lambda x: x.T  # noqa: E731  [out, in] -> [in, out]
    same = lambda x: x  # noqa: E731
    v, m = "vision_tower.", "multi_modal_projector."
    out = {v + "embeddings.patch_embedding.weight": ("patch_embed", None,
                                                     lambda x: x.reshape(E, -1).T, 2),
           v + "embeddings.patch_embedding.bias": ("patch_bias", None, same, 1),
           v + "embeddings.position_embedding.weight": ("pos_embed", None, same, 2),
           v + "post_layernorm.weight": ("post_ln", None, same, 1),
           v + "post_layernorm.bias": ("post_ln_bias", None, same, 1),
           m + "mm_soft_emb_norm.weight": ("soft_norm", None, same, 1),
           m + "mm_input_projection_weight": ("projection", None, same, 2)}
    for i in range(spec.depth):
        p = f"{v}encoder.layers.{i}."
        for hf, name in (("layer_norm1.weight", "ln1"), ("layer_norm1.bias", "ln1_bias"),
                         ("layer_norm2.weight", "ln2"), ("layer_norm2.bias", "ln2_bias"),
                         ("self_attn.out_proj.weight", "out"),
                         ("self_attn.out_proj.bias", "out_bias"),
                         ("mlp.fc1.weight", "fc1"), ("mlp.fc1.bias", "fc1_bias"),
                         ("mlp.fc2.weight", "fc2"), ("mlp.fc2.bias", "fc2_bias")):
            matrix = hf.endswith(".weight") and "norm" not in hf
            out[p + hf] = (name, i, T if matrix else same, 2 if matrix else 1)
        for j, part in enumerate("qkv"):
            out[p + f"self_attn.{part}_proj.weight"] = ("qkv", i, T, (0, j * E))
            out[p + f"self_attn.{part}_proj.bias"] = ("qkv_bias", i, same, (j * E,))
    return out


def checkpoint_name(name: str):
    """A Gemma 3 multimodal checkpoint's tensor name as the text model's targets and
    `vision_targets` spell it: published checkpoints say language_model.model.* and
    vision_tower.vision_model.*, transformers 5 saves model.language_model.* and
    model.vision_tower.* (without the vision_model level). None: SigLIP's pooling head
    (vision_use_head), which Gemma 3 never runs (it reads the last hidden states)."""
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        name = name[len("model."):]
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model."):]
    if name.startswith("vision_tower.head."):
        return None
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name
