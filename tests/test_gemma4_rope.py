"""Gemma 4's `proportional` RoPE (its full-attention layers), the first piece of Gemma 4: the
tables and the rotation equal transformers' for the layer type's head dim."""

import numpy as np
import pytest
import torch


@pytest.mark.parametrize("proportion,factor", [(0.25, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_proportional_rope_matches_transformers(proportion, factor):
    import jax.numpy as jnp
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

    from jaxllm.models.rope import RopeSpec, apply_rope, rope_tables

    params = {"rope_type": "proportional", "partial_rotary_factor": proportion,
              "rope_theta": 1_000_000.0, "factor": factor}
    hf = Gemma4TextConfig(num_hidden_layers=2, head_dim=16, global_head_dim=32,
                          layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                 "rope_theta": 10_000.0},
                                           "full_attention": params})
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](hf, None, layer_type="full_attention")
    spec = RopeSpec.from_hf(params, 256)
    assert spec.partial_rotary_factor == 1.0  # the tables span the whole head
    pos = jnp.arange(40, dtype=jnp.int32)
    cos, sin = rope_tables((spec,), 32, pos, jnp.float32)
    freqs = np.arange(40)[:, None] * want.numpy()[None]
    np.testing.assert_allclose(np.asarray(cos[0]), np.cos(freqs), atol=1e-6)
    rotated = int(proportion * 16)  # pairs with a nonzero frequency
    assert np.all(np.asarray(sin[0])[:, rotated:] == 0) and np.abs(sin[0][:, :rotated]).max() > 0.5
    x = np.random.default_rng(0).standard_normal((40, 2, 32)).astype(np.float32)
    emb = torch.cat([torch.tensor(freqs), torch.tensor(freqs)], -1).float()[None]
    theirs = apply_rotary_pos_emb(torch.tensor(x)[None], emb.cos(), emb.sin(), unsqueeze_dim=2)
    ours = apply_rope(jnp.asarray(x), cos[0], sin[0])
    np.testing.assert_allclose(np.asarray(ours), theirs[0].numpy(), atol=1e-5)
