"""What the model config says about a vision tower and its multimodal rotary positions: plain
values (hashable, so the model stays a static jit argument), read from a transformers config.

Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`, jaxllm/models/qwen2_5_vl.py), Qwen3-VL
(jaxllm/models/qwen3_vl.py, its spec there) and Gemma 3 (`Gemma3ForConditionalGeneration`,
jaxllm/models/gemma3_vision.py) have their towers; other
multimodal architectures are refused or loaded text-only by the registry.
"""

from __future__ import annotations

import dataclasses

from jaxllm.config import ConfigError


class QwenPatches:
    """The patch geometry both Qwen-VL towers derive from their fields (hidden_size,
    num_heads, in_channels, temporal_patch_size, patch_size, spatial_merge_size)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values of one flattened patch (channels x temporal x patch x patch)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


@dataclasses.dataclass(frozen=True)
class VisionSpec(QwenPatches):
    """A Qwen2.5-VL vision transformer: patch embedding (a Conv3d of stride = kernel, i.e. one
    matmul per patch), `depth` pre-norm blocks, windowed except `fullatt_block_indexes`, and a
    2x2 patch merger projecting to the language model's width."""
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    activation: str
    rope_theta: float
    image_token_id: int

    @classmethod
    def from_hf(cls, top) -> "VisionSpec":
        """From a Qwen2.5-VL top-level config (its `vision_config` and token ids)."""
        v = top.vision_config
        rope = getattr(v, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"Qwen2.5-VL vision rope_type {rope['rope_type']!r} is not "
                              "supported (axial only)")
        if v.hidden_size % v.num_heads or (v.hidden_size // v.num_heads) % 4:
            raise ConfigError(f"vision hidden_size {v.hidden_size} over {v.num_heads} heads "
                              "must give a head_dim divisible by 4 (axial RoPE)")
        return cls(depth=v.depth, hidden_size=v.hidden_size,
                   intermediate_size=v.intermediate_size, num_heads=v.num_heads,
                   in_channels=v.in_channels, patch_size=v.patch_size,
                   temporal_patch_size=v.temporal_patch_size,
                   spatial_merge_size=v.spatial_merge_size, window_size=v.window_size,
                   out_hidden_size=v.out_hidden_size,
                   fullatt_block_indexes=tuple(v.fullatt_block_indexes),
                   activation=v.hidden_act, rope_theta=float(rope.get("rope_theta", 10000.0)),
                   image_token_id=int(top.image_token_id))


def mrope_section(text_config) -> tuple[int, ...]:
    """The M-RoPE split of head_dim // 2 rotary frequencies into (temporal, height, width)."""
    params = getattr(text_config, "rope_parameters", None) or {}
    section = tuple(int(s) for s in params.get("mrope_section") or ())
    half = (getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads) // 2
    if len(section) != 3 or sum(section) != half:
        raise ConfigError(f"mrope_section {list(section)} must be three sizes summing to "
                          f"head_dim // 2 = {half}")
    return section


@dataclasses.dataclass(frozen=True)
class Gemma3VisionSpec:
    """A SigLIP tower and Gemma 3's projector, with the prompt's image tokens."""
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    activation: str
    out_hidden_size: int      # the language model's hidden size
    mm_tokens_per_image: int
    image_token_id: int       # the soft tokens the image's embeddings replace
    boi_token_id: int         # <start_of_image>: the prompt's one placeholder per image
    eoi_token_id: int         # <end_of_image>

    # In prefill an image's tokens attend to all of the image (transformers' token_type_ids
    # mask): `AttentionMetadata.attend_to`.
    bidirectional_images = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return int(round(self.mm_tokens_per_image ** 0.5))

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.patch_size ** 2

    @classmethod
    def from_hf(cls, top) -> "Gemma3VisionSpec":
        """From a Gemma 3 top-level config (its `vision_config` and token ids)."""
        v = top.vision_config
        side, per_side = v.image_size // v.patch_size, int(round(top.mm_tokens_per_image ** 0.5))
        if (v.image_size % v.patch_size or per_side ** 2 != top.mm_tokens_per_image
                or side % per_side):
            raise ConfigError(f"Gemma 3 vision: image_size {v.image_size} / patch_size "
                              f"{v.patch_size} must be a whole patch grid that "
                              f"mm_tokens_per_image {top.mm_tokens_per_image} (a square) pools "
                              "evenly")
        if v.hidden_size % v.num_attention_heads:
            raise ConfigError(f"vision hidden_size {v.hidden_size} does not divide into "
                              f"{v.num_attention_heads} heads")
        return cls(depth=v.num_hidden_layers, hidden_size=v.hidden_size,
                   intermediate_size=v.intermediate_size, num_heads=v.num_attention_heads,
                   in_channels=v.num_channels, image_size=v.image_size,
                   patch_size=v.patch_size, layer_norm_eps=float(v.layer_norm_eps),
                   activation=v.hidden_act, out_hidden_size=top.text_config.hidden_size,
                   mm_tokens_per_image=int(top.mm_tokens_per_image),
                   image_token_id=int(top.image_token_id), boi_token_id=int(top.boi_token_id),
                   eoi_token_id=int(top.eoi_token_id))


def bidirectional_images(model_config) -> bool:
    """Whether the model's image tokens attend to their whole image in prefill (Gemma 3, as
    transformers' token_type_ids mask), not causally: `AttentionMetadata.attend_to`."""
    return getattr(model_config.vision, "bidirectional_images", False)


def deepstack_levels(model_config) -> int:
    """Qwen3-VL's deepstack levels (0 for other models): feature sets the tower returns beside
    the image embeddings, each added to the image tokens after one of the first decoder layers
    (jaxllm/models/qwen3_vl.py)."""
    return len(getattr(model_config.vision, "deepstack_visual_indexes", ()))


def mm_embed_width(model_config) -> int:
    """Values of one image token's row in a step's image embeddings: the hidden size, times
    1 + the deepstack levels (Qwen3-VL)."""
    return model_config.hidden_size * (1 + deepstack_levels(model_config))
