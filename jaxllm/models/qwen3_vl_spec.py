"""What a Qwen3-VL config says about its vision tower and its text model's M-RoPE: plain
values (hashable: the model stays a static jit argument). The tower: jaxllm/models/qwen3_vl.py.
"""

from __future__ import annotations

import dataclasses

from jaxllm.config import ConfigError
from jaxllm.models.vision_spec import QwenPatches, mrope_section


@dataclasses.dataclass(frozen=True)
class Qwen3VLVisionSpec(QwenPatches):
    """A Qwen3-VL vision transformer: patch embedding (a Conv3d of stride = kernel, with bias),
    learned position embeddings over a square grid, `depth` pre-LayerNorm blocks of full
    attention within each image, the 2x2 patch merger, and one more merger per deepstack
    level."""
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    activation: str
    rope_theta: float
    image_token_id: int

    @property
    def grid_side(self) -> int:
        """Side of the learned position-embedding grid."""
        return int(round(self.num_position_embeddings ** 0.5))

    @classmethod
    def from_hf(cls, top) -> "Qwen3VLVisionSpec":
        """From a Qwen3-VL top-level config (its `vision_config`, text RoPE and token ids)."""
        v = top.vision_config
        rope = getattr(v, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"Qwen3-VL vision rope_type {rope['rope_type']!r} is not "
                              "supported (axial only)")
        if v.hidden_size % v.num_heads or (v.hidden_size // v.num_heads) % 4:
            raise ConfigError(f"vision hidden_size {v.hidden_size} over {v.num_heads} heads "
                              "must give a head_dim divisible by 4 (axial RoPE)")
        side = int(round(v.num_position_embeddings ** 0.5))
        if side * side != v.num_position_embeddings:
            raise ConfigError(f"vision num_position_embeddings {v.num_position_embeddings} "
                              "must be a square (the learned position grid)")
        levels = tuple(int(i) for i in v.deepstack_visual_indexes)
        text_layers = top.get_text_config().num_hidden_layers
        if len(set(levels)) != len(levels) or any(not 0 <= i < v.depth for i in levels) \
                or len(levels) > text_layers:
            raise ConfigError(f"deepstack_visual_indexes {list(levels)} must be distinct "
                              f"blocks of the {v.depth}-block vision tower, at most one per "
                              f"decoder layer ({text_layers})")
        if list(levels) != sorted(levels):  # the features enter the decoder in block order
            raise ConfigError(f"deepstack_visual_indexes {list(levels)} must be increasing")
        return cls(depth=v.depth, hidden_size=v.hidden_size,
                   intermediate_size=v.intermediate_size, num_heads=v.num_heads,
                   in_channels=v.in_channels, patch_size=v.patch_size,
                   temporal_patch_size=v.temporal_patch_size,
                   spatial_merge_size=v.spatial_merge_size, out_hidden_size=v.out_hidden_size,
                   num_position_embeddings=v.num_position_embeddings,
                   deepstack_visual_indexes=levels, activation=v.hidden_act,
                   rope_theta=float(rope.get("rope_theta", 10000.0)),
                   image_token_id=int(top.image_token_id))


def text_features(c) -> dict:
    """The ModelConfig fields of Qwen3-VL's text model beyond Qwen3's: M-RoPE's section with
    the frequencies interleaved over (t, h, w), as transformers' Qwen3VLTextRotaryEmbedding
    always does (a config saying mrope_interleaved=false is refused: transformers would
    ignore it, vLLM would not)."""
    params = getattr(c, "rope_parameters", None) or {}
    if params.get("mrope_interleaved", True) is not True:
        raise ConfigError(f"Qwen3-VL mrope_interleaved={params['mrope_interleaved']!r} is not "
                          "supported (transformers always interleaves)")
    return dict(mrope_section=mrope_section(c), mrope_interleaved=True)
