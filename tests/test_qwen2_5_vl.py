"""Qwen2.5-VL's vision tower, M-RoPE positions and whole-model logits against transformers on a
tiny random checkpoint (float32; images through the PIL image processor)."""

from __future__ import annotations

import numpy as np
import pytest

import vlm_checkpoints as vc

jax = pytest.importorskip("jax")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, load):
    """(transformers model, jaxllm model, ModelConfig, mesh) of one tiny checkpoint."""
    path = str(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))
    hf = vc.build(path)
    model, cfg, mesh = load(path)
    return hf, model, cfg, mesh


def _pixels(images):
    return vc.image_processor()(images=images, return_tensors="np")


def _embeddings(model, px, bucket: int):
    from jaxllm.models.qwen2_5_vl import vision_inputs

    spec = model.cfg.vision
    pv = np.zeros((bucket, spec.patch_values), np.float32)
    pv[:len(px["pixel_values"])] = px["pixel_values"]
    return np.asarray(_encoder(model)(pv, vision_inputs(px["image_grid_thw"], spec, bucket)))


def _encoder(model, _jitted={}):
    """The tower jitted once per model (eager, op by op, it takes seconds)."""
    from flax import nnx

    if id(model) not in _jitted:
        graphdef, state = nnx.split(model)
        fn = jax.jit(lambda s, p, i: nnx.merge(graphdef, s).encode_images(p, i))
        _jitted[id(model)] = lambda p, i: fn(state, p, i)
    return _jitted[id(model)]


def test_vision_tower_matches_transformers(vlm):
    """Two images of different sizes in one padded bucket: windows split both images (window
    2x2 merged tokens, grids 4x6 and 10x4 patches) and block 1 attends over whole images."""
    import torch

    hf, model, cfg, _ = vlm
    px = _pixels([vc.image(0, 60, 90), vc.image(1, 130, 70)])
    assert px["image_grid_thw"].tolist() == [[1, 4, 6], [1, 10, 4]]
    with torch.no_grad():
        ref = hf.model.visual(torch.as_tensor(px["pixel_values"]),
                              grid_thw=torch.as_tensor(px["image_grid_thw"])).pooler_output
    out = _embeddings(model, px, bucket=128)
    np.testing.assert_allclose(out[:len(ref)], ref.numpy(), atol=2e-4, rtol=1e-4)
    # the padding is not part of any image: the first image alone gives its rows unchanged
    alone = _embeddings(model, _pixels([vc.image(0, 60, 90)]), bucket=64)
    np.testing.assert_allclose(alone[:6], out[:6], atol=2e-5)


def test_mrope_positions_match_transformers(vlm):
    import torch

    from jaxllm.models.qwen2_5_vl import mrope_positions

    hf, _, cfg, _ = vlm
    tok = vc.tokenizer()
    px = _pixels([vc.image(0, 60, 90), vc.image(1, 130, 70)])
    text = vc.PROMPT.replace("Describe", "<|vision_start|><|image_pad|><|vision_end|>Describe")
    ids = vc.expand(tok.encode(text), px["image_grid_thw"], cfg.vision.image_token_id)
    pos, delta = mrope_positions(ids, px["image_grid_thw"], cfg.vision)
    t = torch.tensor([ids])
    ref, ref_delta = hf.model.get_rope_index(
        t, (t == cfg.vision.image_token_id).int(), torch.as_tensor(px["image_grid_thw"]))
    np.testing.assert_array_equal(pos, ref[:, 0].numpy())
    assert delta == int(ref_delta) and delta < 0  # images take fewer positions than tokens
    with pytest.raises(ValueError, match="more image placeholder tokens"):
        mrope_positions(ids, px["image_grid_thw"][:1], cfg.vision)


def _greedy(model, cfg, mesh, ids, px, new_tokens):
    """Prefill (image rows from the tower) then greedy decode at index + delta positions,
    through the paged cache: the tokens and each step's logits."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.layers.attention import AttentionMetadata, empty_kv_caches, kv_cache_shardings
    from jaxllm.models.qwen2_5_vl import mrope_positions

    spec, bs, nb, T = cfg.vision, 4, 48, 128
    grids = px["image_grid_thw"] if px is not None else []
    pos, delta = mrope_positions(ids, grids, spec)
    rows = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    emb = _embeddings(model, px, bucket=256) if px is not None else []
    shapes = model.kv_cache_shapes(nb, bs)
    cache = empty_kv_caches(shapes, cfg.jnp_dtype, kv_cache_shardings(shapes, mesh))
    graphdef, state = nnx.split(model)
    state = model.backend.relayout(jax.jit(lambda s: jax.tree.map(jnp.copy, s))(state), cfg)

    @jax.jit
    def step(state, cache, ids, pos, md, mm):
        m = nnx.merge(graphdef, state)
        h, cache = m(cache, ids, pos, md, None, mm)
        return m.compute_logits(h), cache

    table = np.arange(nb, dtype=np.int32)[None]

    def run(cache, tokens, p3, start, mm_rows):
        n = len(tokens)
        tid, P = np.zeros(T, np.int32), np.zeros((3, T), np.int32)
        tid[:n], P[:, :n] = tokens, p3
        slots, p = np.full(T, -1, np.int32), np.arange(start, start + n)
        slots[:n] = table[0][p // bs] * bs + p % bs
        md = AttentionMetadata(slots, np.array([start + n, 0], np.int32),
                               np.concatenate([table, table * 0]),
                               np.array([0, n, n], np.int32), np.array([1], np.int32))
        E, M = np.zeros((T, cfg.hidden_size), np.float32), np.zeros(T, bool)
        for r, e in mm_rows:
            E[r], M[r] = e, True
        lg, cache = step(state, cache, tid, P, md, (E, M))
        return np.asarray(lg)[:n], cache

    lg, cache = run(cache, ids, pos, 0, list(zip(rows, emb)))
    tokens, logits = [int(lg[-1].argmax())], [lg[-1]]
    for k in range(new_tokens - 1):
        i = len(ids) + k
        lg, cache = run(cache, [tokens[-1]], np.full((3, 1), i + delta), i, [])
        tokens.append(int(lg[-1].argmax()))
        logits.append(lg[-1])
    return tokens, np.stack(logits)


@pytest.mark.parametrize("images", [0, 1, 2])
def test_logits_match_transformers(vlm, images):
    """Greedy tokens and every step's logits equal transformers' generate: text only, one
    image, two images of different sizes (the text after each image continues from its
    M-RoPE start + max(h, w); decode positions from the max + 1)."""
    hf, model, cfg, mesh = vlm
    tok = vc.tokenizer()
    imgs = [vc.image(0, 60, 90), vc.image(1, 130, 70)][:images]
    text = vc.PROMPT
    if images == 0:
        text = text.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
    elif images == 2:
        text = text.replace("Describe", "<|vision_start|><|image_pad|><|vision_end|>Describe")
    px = _pixels(imgs) if imgs else None
    ids = vc.expand(tok.encode(text), px["image_grid_thw"] if px else [],
                    cfg.vision.image_token_id)
    ref_tokens, ref_logits = vc.hf_generate(hf, ids, px and px["pixel_values"],
                                            px and px["image_grid_thw"], 6)
    tokens, logits = _greedy(model, cfg, mesh, ids, px, 6)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_encoder_and_step_export_for_accelerators(platform):
    """The vision tower and the forward with image rows and M-RoPE positions, exported with
    the Pallas backend for TPU and CUDA from this CPU host: the platform's attention kernel,
    nothing CPU-only."""
    from jaxllm.config import EngineArgs
    from jaxllm.models.model_config import ModelConfig
    from jaxllm.models.qwen2_5_vl import vision_inputs

    cfg = ModelConfig.from_hf(vc.config(vc.tokenizer()),
                              EngineArgs(model="tiny", dtype="bfloat16").create_engine_config()
                              .model)
    assert_vlm_step_exports(cfg, vision_inputs, platform)


def assert_vlm_step_exports(cfg, vision_inputs, platform: str) -> None:
    """Export a Qwen-VL model's tower and forward (image rows scattered into a 16-token step)
    with the Pallas backend for `platform`: only the platform's attention kernel is a custom
    call, nothing CPU-only. vision_inputs: the model module's host-input builder."""
    import re

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax import export

    from jaxllm.layers.attention import AttentionMetadata, KVCache
    from jaxllm.layers.backends.pallas import PallasBackend
    from jaxllm.models.decoder import abstract_decoder
    from test_export import CPU_ONLY, KERNEL, UNCHECKED

    model = abstract_decoder(cfg, PallasBackend(None))
    graphdef, state = nnx.split(model)
    T, S, N = 16, 4, 64

    def step(state, caches, ids, pos, md, patches, inp, rows):
        m = nnx.merge(graphdef, state)
        emb = m.encode_images(patches, inp)
        mm = (jnp.zeros((T, emb.shape[1]), emb.dtype).at[rows].set(emb),
              jnp.zeros(T, bool).at[rows].set(True))  # the image's rows of the step
        hidden, caches = m(caches, ids, pos, md, None, mm)
        return m.compute_logits(hidden), caches

    sds = jax.ShapeDtypeStruct
    i32 = lambda *shape: sds(shape, jnp.int32)  # noqa: E731
    params = jax.tree.map(lambda v: sds(v.shape, v.dtype), state,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    caches = tuple(KVCache(sds(s, cfg.jnp_dtype), sds(s, cfg.jnp_dtype))
                   for s in model.kv_cache_shapes(32, 16))
    md = AttentionMetadata(i32(T), i32(S), i32(S, 8), i32(S + 1), i32(1))
    inp = jax.tree.map(lambda a: sds(a.shape, a.dtype), vision_inputs([(1, 4, 6)], cfg.vision, N))
    exported = export.export(jax.jit(step, donate_argnums=1), platforms=(platform,),
                             disabled_checks=UNCHECKED)(
        params, caches, i32(T), i32(3, T), md, sds((N, cfg.vision.patch_values), jnp.float32),
        inp, i32(N // 4))
    text = exported.mlir_module()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL[platform]}
    assert not [name for name in CPU_ONLY if name in text]
