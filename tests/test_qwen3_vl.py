"""Qwen3-VL images (tiny random checkpoint, float32): the vision tower with its deepstack
features and the interleaved M-RoPE tables against transformers, `LLM.generate` / `LLM.chat`
with images giving transformers' greedy tokens and logprobs (chunked prefill splitting a prompt
inside an image, text-only requests beside), a check that the comparison sees deepstack, and
the refusals."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import qwen3vl_checkpoints as qc
import vlm_checkpoints as vc

TWO = vc.PROMPT.replace("Describe", "<|vision_start|><|image_pad|><|vision_end|>Describe")
TEXT = vc.PROMPT.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
IMAGES = [vc.image(0, 60, 90), vc.image(1, 130, 70)]  # 6 and 8 image tokens
NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen3_vl"))
    return path, qc.build(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    """Chunks of at most 16 tokens: the two-image prompt is split inside its second image."""
    from jaxllm import LLM

    return LLM(ckpt[0], dtype="float32", max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=16, enable_prefix_caching=True, block_size=4)


def _greedy(logprobs=None):
    from jaxllm import SamplingParams

    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def _logprobs(logits, tokens):
    import torch

    ref = torch.log_softmax(torch.as_tensor(logits), -1).numpy()
    return ref[np.arange(len(tokens)), tokens]


def test_tower_and_deepstack_match_transformers(ckpt, llm):
    """Two images of different sizes in one padded bucket: the merged embeddings and both
    deepstack levels (grids 4x6 and 8x4 patches resample the 4x4 position grid)."""
    import jax
    import torch
    from flax import nnx

    from jaxllm.models.qwen3_vl import vision_inputs

    hf = ckpt[1]
    graphdef, state = llm.llm_engine.runner.graphdef, llm.llm_engine.runner.state
    spec = llm.llm_engine.model_config.vision
    encode = jax.jit(lambda s, p, i: nnx.merge(graphdef, s).encode_images(p, i))

    def ours(images, bucket):
        px = qc.pixels(images)
        pv = np.zeros((bucket, spec.patch_values), np.float32)
        pv[:len(px["pixel_values"])] = px["pixel_values"]
        return np.asarray(encode(state, pv, vision_inputs(px["image_grid_thw"], spec, bucket)))

    px = qc.pixels(IMAGES)
    assert px["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]]
    with torch.no_grad():
        out = hf.model.visual(torch.as_tensor(px["pixel_values"]),
                              grid_thw=torch.as_tensor(px["image_grid_thw"]))
    ref = torch.cat([out.pooler_output, *out.deepstack_features], -1).numpy()
    got = ours(IMAGES, 64)  # 56 patches: the engine's smallest bucket (one program)
    assert ref.shape == (14, 3 * 64)
    np.testing.assert_allclose(got[:14], ref, atol=5e-5, rtol=1e-5)
    # the padding is no part of any image: the first image alone gives its rows unchanged
    np.testing.assert_allclose(ours(IMAGES[:1], 64)[:6], got[:6], atol=2e-5)


def test_interleaved_mrope_tables_match_transformers():
    """rope_tables with mrope_interleaved against transformers' Qwen3VLTextRotaryEmbedding,
    for the real checkpoints' section [24, 20, 20] (the last frequencies stay temporal) and
    distinct positions on the three axes."""
    import jax.numpy as jnp
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from jaxllm.models.rope import RopeSpec, rope_tables

    params = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
              "mrope_interleaved": True}
    cfg = qc.config(vc.tokenizer(), dict(head_dim=128, rope_parameters=params)).text_config
    pos = np.random.RandomState(0).randint(0, 300, (3, 7))
    cos, sin = Qwen3VLTextRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32),
                                               torch.as_tensor(pos)[:, None])
    ours = rope_tables((RopeSpec.from_hf(params, 512),), 128, jnp.asarray(pos, jnp.int32),
                       jnp.float32, (24, 20, 20), True)
    np.testing.assert_allclose(np.asarray(ours[0][0]), cos[0, :, :64].numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ours[1][0]), sin[0, :, :64].numpy(), atol=1e-5)
    plain = rope_tables((RopeSpec.from_hf(params, 512),), 128, jnp.asarray(pos, jnp.int32),
                        jnp.float32, (24, 20, 20), False)
    assert np.abs(np.asarray(plain[0][0]) - cos[0, :, :64].numpy()).max() > 0.1


def _cases():
    return [(vc.PROMPT, IMAGES[:1]), (TWO, IMAGES), (TEXT, [])]


def test_batch_of_image_and_text_prompts_matches_transformers(ckpt, llm):
    """One image, two images of different sizes, text only: one batch, chunked prefill split
    inside the second image; the tokens and their logprobs. Then transformers without
    deepstack disagrees with those logprobs: the comparison would catch a skipped deepstack."""
    import copy

    import torch

    hf = ckpt[1]
    refs = [qc.reference(hf, text, imgs, NEW) for text, imgs in _cases()]
    image = hf.config.image_token_id
    second = [i for i, t in enumerate(refs[1][0]) if t == image][6:]
    assert second[0] < 16 <= second[-1]  # the first 16-token chunk ends inside image 2
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
               for text, imgs in _cases()]
    outs = llm.generate(prompts, _greedy(logprobs=0), use_tqdm=False)
    got = []
    for (ids, tokens, logits), out in zip(refs, outs):
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens
        got.append([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        np.testing.assert_allclose(got[-1], _logprobs(logits, tokens), atol=1e-4)

    flat = copy.deepcopy(hf)  # its deepstack mergers output zeros: nothing added
    with torch.no_grad():
        for merger in flat.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
    ids, tokens, logits = qc.reference(flat, vc.PROMPT, IMAGES[:1], NEW)
    assert ids == refs[0][0]
    assert np.abs(np.asarray(got[0]) - _logprobs(logits, refs[0][1])).max() > 1e-2


def test_chat_with_image_parts(ckpt, llm):
    messages = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": IMAGES[1]},
        {"type": "text", "text": "Describe the image."}]}]
    out = llm.chat(messages, _greedy(), use_tqdm=False)[0]
    text = vc.tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": "Describe the image."}]}],
        tokenize=False, add_generation_prompt=True)
    ids, tokens, _ = qc.reference(ckpt[1], text, IMAGES[1:], NEW)
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == tokens


def test_prefix_cache_is_keyed_by_the_image(ckpt, llm):
    """The same image again hits the cache past its tokens (their deepstack rows included:
    the tokens stay transformers'); one pixel changed misses it."""
    from PIL import Image

    hf = ckpt[1]
    image = vc.image(7, 90, 60)
    pixels = np.asarray(image).copy()
    pixels[30, 30, 0] ^= 1
    changed = Image.fromarray(pixels)
    ids, ref, _ = qc.reference(hf, vc.PROMPT, [image], NEW)
    first = ids.index(hf.config.image_token_id)
    outs = [llm.generate({"prompt": vc.PROMPT, "multi_modal_data": {"image": im}}, _greedy(),
                         use_tqdm=False)[0] for im in (image, image, changed)]
    assert [list(o.outputs[0].token_ids) for o in outs[:2]] == [ref, ref]
    assert outs[1].num_cached_tokens > first + 6
    assert outs[2].num_cached_tokens <= first


def test_bad_inputs_are_refused_by_name(llm):
    bad = [({"video": IMAGES[0]}, "'video' is not supported"),
           ({"image": "not an image"}, "is a str, not a PIL.Image"),
           ({"image": IMAGES}, "1 image placeholder")]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt": vc.PROMPT, "multi_modal_data": data}, _greedy(),
                         use_tqdm=False)


@pytest.mark.parametrize("change, message", [
    (dict(text_overrides={"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                              "mrope_section": [4, 2, 2],
                                              "mrope_interleaved": False}}),
     "mrope_interleaved=False is not supported"),
    (dict(deepstack_visual_indexes=[1, 0]), r"deepstack_visual_indexes \[1, 0\] must be incr"),
    (dict(deepstack_visual_indexes=[0, 3]), r"\[0, 3\] must be distinct blocks"),
    (dict(num_position_embeddings=15), "num_position_embeddings 15 must be a square"),
])
def test_bad_configs_are_refused_by_name(change, message):
    from jaxllm.config import ConfigError
    from jaxllm.models.model_config import ModelConfig

    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(qc.config(vc.tokenizer(), **change))


@pytest.mark.slow  # ~13 s; tests/test_qwen2_5_vl.py exports the image path in the default set
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_encoder_and_step_export_for_accelerators(platform):
    """The tower and the forward with image rows carrying two deepstack levels, exported with
    the Pallas backend for TPU and CUDA from this CPU host: the platform's attention kernel,
    nothing CPU-only."""
    from jaxllm.config import EngineArgs
    from jaxllm.models.model_config import ModelConfig
    from jaxllm.models.qwen3_vl import vision_inputs
    from jaxllm.models.vision_spec import mm_embed_width
    from test_qwen2_5_vl import assert_vlm_step_exports

    cfg = ModelConfig.from_hf(qc.config(vc.tokenizer()),
                              EngineArgs(model="tiny", dtype="bfloat16").create_engine_config()
                              .model)
    assert mm_embed_width(cfg) == 3 * cfg.hidden_size  # the main rows and two deepstack levels
    assert_vlm_step_exports(cfg, vision_inputs, platform)


@pytest.mark.slow
def test_moe_matches_transformers_in_both_expert_layouts(tmp_path):
    """Qwen3-VL-MoE (4 experts, top 2, a dense layer between): one image and text only give
    transformers' tokens and logprobs (expert-load metrics on, which count the routes of
    every prompt token); its experts rewritten in the published [in, out] layout load to the
    same weights."""
    import shutil

    import jax
    from flax import nnx
    from safetensors.numpy import load_file, save_file

    from conftest import load_tiny
    from jaxllm import LLM

    path = tmp_path / "moe"
    hf = qc.build(str(path), moe=True)
    # with expert-load metrics: that forward takes the image rows too
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, block_size=4, enable_expert_load_metrics=True)
    cases = [(vc.PROMPT, IMAGES[:1]), (TEXT, [])]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} if i else t
                         for t, i in cases], _greedy(logprobs=0), use_tqdm=False)
    for (text, imgs), out in zip(cases, outs):
        ids, tokens, logits = qc.reference(hf, text, imgs, NEW)
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        np.testing.assert_allclose(got, _logprobs(logits, tokens), atol=1e-4)

    published = tmp_path / "published"
    shutil.copytree(path, published)
    tensors = load_file(path / "model.safetensors")
    experts = [k for k in tensors if ".mlp.experts." in k]
    assert len(experts) == 4  # gate_up and down of the two sparse layers
    for k in experts:
        tensors[k] = np.ascontiguousarray(tensors[k].transpose(0, 2, 1))
    save_file(tensors, str(published / "model.safetensors"), metadata={"format": "pt"})
    a, b = (jax.tree.leaves(nnx.state(load_tiny(str(p))[0])) for p in (path, published))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_a_published_config_reads(tmp_path):
    """Qwen3-VL-2B-Instruct's config.json as published (transformers 4.57: the legacy
    rope_scaling spelling): interleaved M-RoPE, tied head, the tower's spec."""
    from transformers import AutoConfig

    from jaxllm.models.model_config import ModelConfig

    text = dict(attention_bias=False, bos_token_id=151643, eos_token_id=151645, head_dim=128,
                hidden_act="silu", hidden_size=2048, intermediate_size=6144,
                max_position_embeddings=262144, model_type="qwen3_vl_text",
                num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8,
                rms_norm_eps=1e-06, rope_theta=5000000, tie_word_embeddings=True,
                vocab_size=151936, rope_scaling={"mrope_interleaved": True, "rope_type": "default",
                                                 "mrope_section": [24, 20, 20]})
    vision = dict(deepstack_visual_indexes=[5, 11, 17], depth=24, hidden_act="gelu_pytorch_tanh",
                  hidden_size=1024, in_channels=3, intermediate_size=4096, model_type="qwen3_vl",
                  num_heads=16, num_position_embeddings=2304, out_hidden_size=2048,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl",
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=True, text_config=text,
        vision_config=vision)))
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    assert (cfg.mrope_section, cfg.mrope_interleaved, cfg.tie_word_embeddings) == \
        ((24, 20, 20), True, True)
    assert cfg.qk_norm and cfg.rope[0].theta == 5e6 and cfg.num_layers == 28
    assert cfg.vision.deepstack_visual_indexes == (5, 11, 17) and cfg.vision.grid_side == 48
    assert cfg.vision.image_token_id == 151655 and cfg.vision.out_hidden_size == 2048


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_lm_head_ties_as_the_top_level_config_says(tie, family):
    """transformers ties Qwen3-VL's and Qwen2.5-VL's LM head by the top-level
    tie_word_embeddings; the text config of a published checkpoint need not repeat it."""
    from jaxllm.models.model_config import ModelConfig

    cfg = (qc if family == "qwen3_vl" else vc).config(vc.tokenizer())
    cfg.tie_word_embeddings = tie
    if hasattr(cfg.text_config, "tie_word_embeddings"):
        del cfg.text_config.tie_word_embeddings
    assert ModelConfig.from_hf(cfg).tie_word_embeddings is tie


def _two_prompts():
    return [{"prompt": vc.PROMPT, "multi_modal_data": {"image": IMAGES[0]}},
            {"prompt": TWO, "multi_modal_data": {"image": IMAGES}}]


@pytest.mark.slow
def test_tensor_parallel_2_equals_one_device(ckpt, llm):
    """Two virtual devices (the tower replicated, the decoder sharded): the same tokens."""
    from conftest import run_with_host_devices

    proc = run_with_host_devices(2, [__file__, ckpt[0]])
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tp2 == [list(o.outputs[0].token_ids)
                   for o in llm.generate(_two_prompts(), _greedy(), use_tqdm=False)]


if __name__ == "__main__":  # the tensor-parallel run (python this_file CHECKPOINT)
    from jaxllm import LLM

    tp_llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, max_num_seqs=4,
                 max_num_batched_tokens=16, block_size=4, tensor_parallel_size=2)
    outs = tp_llm.generate(_two_prompts(), _greedy(), use_tqdm=False)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
