"""Gemma 3 images (tiny random checkpoint, float32): the SigLIP tower and projector against
transformers, and `LLM.generate` / `LLM.chat` with images giving transformers' greedy tokens
and logprobs, with the image tokens attending to each other (its token_type_ids mask)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import gemma3v_checkpoints as gc

TWO = gc.PROMPT.replace("Describe", "<start_of_image>Describe")
TEXT = gc.PROMPT.replace("<start_of_image>", "")
IMAGES = [gc.image(0, 60, 90), gc.image(1, 40, 30)]
NEW = 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_gemma3v"))
    return path, gc.build(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    """Chunks of at most 16 tokens: the two-image prompt's second image would straddle the
    first chunk's end, so the scheduler ends that chunk before it."""
    from jaxllm import LLM

    return LLM(ckpt[0], dtype="float32", max_model_len=96, max_num_seqs=4,
               max_num_batched_tokens=16, enable_prefix_caching=True, block_size=4)


def _greedy(logprobs=None):
    from jaxllm import SamplingParams

    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def test_tower_and_projector_match_transformers(ckpt, llm):
    import jax
    import torch
    from flax import nnx

    model = llm.llm_engine.runner.graphdef, llm.llm_engine.runner.state
    px = np.concatenate([gc.inputs(gc.PROMPT, [im])["pixel_values"] for im in IMAGES])
    with torch.no_grad():
        ref = ckpt[1].model.get_image_features(torch.as_tensor(px)).pooler_output.numpy()
    out = jax.jit(lambda s, p: nnx.merge(model[0], s).encode_images(p, None))(model[1], px)
    assert out.shape == ref.shape == (2, gc.TOKENS, 64)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)


def test_images_and_text_match_transformers(ckpt, llm):
    """One image, two images, text only, in one batch: the expanded prompt equals the
    processor's input_ids, and the tokens and logprobs equal transformers' generate with its
    pixel_values and token_type_ids."""
    import torch

    hf = ckpt[1]
    cases = [(gc.PROMPT, IMAGES[:1]), (TWO, IMAGES), (TEXT, [])]
    refs = []
    for text, imgs in cases:
        inp = gc.inputs(text, imgs)
        refs.append((inp["input_ids"][0].tolist(), *gc.hf_generate(hf, inp, NEW)))
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
               for text, imgs in cases]
    soft = [i for i, t in enumerate(refs[1][0]) if t == hf.config.image_token_id]
    assert soft[4] < 16 < soft[-1] + 1  # a 16-token chunk would end inside image 2
    outs = llm.generate(prompts, _greedy(logprobs=0), use_tqdm=False)
    for (ids, tokens, logits), out in zip(refs, outs):
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens
        ref = torch.log_softmax(torch.as_tensor(logits), -1).numpy()
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        np.testing.assert_allclose(got, ref[np.arange(NEW), tokens], atol=2e-4)


def test_image_tokens_attend_to_their_whole_image(ckpt):
    """transformers without token_type_ids (causal image tokens) gives other logits: the
    parity above holds only with the bidirectional mask."""
    import torch

    inp = gc.inputs(TWO, IMAGES)
    with torch.no_grad():
        causal = ckpt[1](input_ids=torch.as_tensor(inp["input_ids"]),
                         pixel_values=torch.as_tensor(inp["pixel_values"])).logits[0, -1]
    bidirectional = gc.hf_generate(ckpt[1], inp, 1)[1][0]
    assert np.abs(causal.numpy() - bidirectional).max() > 1e-2


def test_checkpoint_names_of_both_layouts():
    """Published checkpoints' names and transformers 5's map to the same targets; SigLIP's
    unused pooling head is skipped (the tiny checkpoint above is transformers 5's)."""
    from jaxllm.models.gemma3_vision import checkpoint_name

    fc1 = "encoder.layers.0.mlp.fc1.weight"
    assert {checkpoint_name("vision_tower.vision_model." + fc1),
            checkpoint_name("model.vision_tower." + fc1),
            checkpoint_name("model.vision_tower.vision_model." + fc1)} == {"vision_tower." + fc1}
    assert checkpoint_name("language_model.model.layers.0.mlp.up_proj.weight") == \
        checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("model.multi_modal_projector.mm_soft_emb_norm.weight") == \
        "multi_modal_projector.mm_soft_emb_norm.weight"
    assert checkpoint_name("vision_tower.vision_model.head.probe") is None


@pytest.mark.parametrize("window", [None, 3])
def test_reference_attention_attend_to(window):
    """attend_to against dense attention with the mask transformers builds for Gemma 3:
    AND(window, OR(causal, same image)), images at prompt positions 2..6 and 9..11 of a
    prefill chunk, beside a decode sequence and padding tokens; two tilings."""
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention
    from test_reference_attention import build_case

    rng = np.random.default_rng(0)
    q_lens, kv_lens, hq, d = [12, 1], [12, 9], 4, 16
    q, kc, vc, kvl, bt, cu, ns, ks, vs = build_case(rng, q_lens, kv_lens, hq, 2, d, 4)
    group = np.full(12, -1)
    group[2:7], group[9:12] = 0, 1
    attend_to = np.zeros(len(q), np.int32)
    attend_to[:12] = [max(i, np.flatnonzero(group == group[i]).max()) if group[i] >= 0 else i
                      for i in range(12)]
    attend_to[12] = 8  # the decode token: its own position
    want = []
    for s, (qq, ql, kl) in enumerate(((q[:12], 12, 12), (q[12:13], 1, 9))):
        k, v = (np.repeat(x[s][:kl], 2, axis=1).astype(np.float64) for x in (ks, vs))
        qpos, kpos = kl - ql + np.arange(ql), np.arange(kl)
        mask = kpos[None] <= qpos[:, None]
        if s == 0:
            mask |= (group[:, None] == group[None]) & (group[:, None] >= 0)
        if window:
            mask &= kpos[None] > qpos[:, None] - window
        sc = np.where(mask[None], np.einsum("qhd,khd->hqk", qq, k) * d ** -0.5, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        want.append(np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v))
    want = np.concatenate(want)
    for q_tile, groups, chunk in [(4, 2, 1), (16, 4, 64)]:
        out = ragged_paged_attention(
            *map(jnp.asarray, (q, kc, vc)), 1, *map(jnp.asarray, (kvl, bt, cu, ns)),
            sm_scale=d ** -0.5, sliding_window=window, attend_to=jnp.asarray(attend_to),
            q_tile=q_tile, tiles_per_group=groups, chunk_blocks=chunk)
        np.testing.assert_allclose(np.asarray(out[:13]), want, atol=2e-5, rtol=2e-5)


def test_chunk_never_ends_inside_an_image():
    """The scheduler's cut: before an image a chunk would end inside, or nothing when the
    chunk starts inside it (a prefix-cache hit) and cannot finish it."""
    from jaxllm.engine.scheduler import image_chunk_cut

    starts, lengths = (5, 20), (4, 4)
    assert image_chunk_cut(starts, lengths, 0, 7) == 5    # would end inside image 1
    assert image_chunk_cut(starts, lengths, 0, 9) == 9    # ends right after it
    assert image_chunk_cut(starts, lengths, 6, 2) == 0    # starts inside, cannot finish it
    assert image_chunk_cut(starts, lengths, 6, 3) == 3
    assert image_chunk_cut(starts, lengths, 9, 13) == 11  # image 2 at 20..23: cut before it


def test_chat_with_image_parts(ckpt, llm):
    messages = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": IMAGES[1]},
        {"type": "text", "text": "Describe the image."}]}]
    out = llm.chat(messages, _greedy(), use_tqdm=False)[0]
    text = gc.tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": "Describe the image."}]}],
        tokenize=False, add_generation_prompt=True)
    inp = gc.inputs(text, IMAGES[1:])
    assert out.prompt_token_ids == inp["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == gc.hf_generate(ckpt[1], inp, NEW)[0]


def test_prefix_cache_is_keyed_by_the_image(ckpt, llm):
    """The same image again hits the cache past its tokens; one pixel changed misses it from
    the block holding the image's first token on, and gives that image's own tokens."""
    from PIL import Image

    image = gc.image(7, 90, 60)
    pixels = np.asarray(image).copy()
    pixels[30, 30, 0] ^= 1
    changed = Image.fromarray(pixels)
    inp = gc.inputs(gc.PROMPT, [image])
    first = inp["input_ids"][0].tolist().index(ckpt[1].config.image_token_id)
    outs = [llm.generate({"prompt": gc.PROMPT, "multi_modal_data": {"image": im}}, _greedy(),
                         use_tqdm=False)[0] for im in (image, image, changed)]
    ref = gc.hf_generate(ckpt[1], inp, NEW)[0]
    assert [list(o.outputs[0].token_ids) for o in outs[:2]] == [ref, ref]
    assert outs[1].num_cached_tokens > first + gc.TOKENS  # past the image's tokens
    assert outs[2].num_cached_tokens <= first  # only the text before it
    assert list(outs[2].outputs[0].token_ids) == gc.hf_generate(
        ckpt[1], gc.inputs(gc.PROMPT, [changed]), NEW)[0]


def test_bad_image_inputs_are_refused_by_name(llm):
    bad = [({"image": IMAGES}, "1 image placeholder.*<start_of_image>"),
           ({"image": "not an image"}, "is a str, not a PIL.Image")]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt": gc.PROMPT, "multi_modal_data": data}, _greedy(),
                         use_tqdm=False)
    images = llm.llm_engine.input_processor.images
    assert images.max_step_tokens == 16  # the engine's --max-num-batched-tokens
    images.max_step_tokens = gc.TOKENS - 1  # as if it were below an image's tokens
    try:
        with pytest.raises(ValueError, match="more than one step's --max-num-batched-tokens 3"):
            llm.generate({"prompt": gc.PROMPT, "multi_modal_data": {"image": IMAGES[0]}},
                         _greedy(), use_tqdm=False)
    finally:
        images.max_step_tokens = 16
    with pytest.raises(ValueError, match="image soft tokens .* must come only from"):
        llm.generate({"prompt": gc.PROMPT + "<image_soft_token>",
                      "multi_modal_data": {"image": IMAGES[0]}}, _greedy(), use_tqdm=False)


def test_pallas_backend_refuses_images_by_name(ckpt):
    """The Pallas kernel is causal only: with it the model runs text, and a prompt with images
    is refused naming the backend rather than run with the wrong mask."""
    from jaxllm import LLM

    llm = LLM(ckpt[0], dtype="float32", max_model_len=96, max_num_seqs=2,
              max_num_batched_tokens=16, attention_backend="pallas", enforce_eager=True)
    assert llm.llm_engine.runner.input_batch.image_spans is False
    with pytest.raises(ValueError, match="--attention-backend pallas .*bidirectionally"):
        llm.generate({"prompt": gc.PROMPT, "multi_modal_data": {"image": IMAGES[0]}},
                     _greedy(), use_tqdm=False)


def test_cpu_backend_runs_images_in_its_native_kernel(llm):
    """The engine above runs the CPU backend, whose native attention kernel takes the image
    tokens' attend_to (so the transformers comparisons ran on it), and --batch-invariant is
    not refused for the model."""
    import jax.numpy as jnp

    from jaxllm.layers.backends import make_backend

    assert llm.llm_engine.runner.backend.name == "cpu"
    assert llm.llm_engine.runner.input_batch.image_spans is True
    assert make_backend("cpu").batch_variance(llm.llm_engine.model_config, jnp.float32) is None


@pytest.mark.slow  # an engine of its own (~20 s)
def test_batch_invariant_images(ckpt):
    """--batch-invariant with images: a request's tokens and logprobs are the same bits alone
    and in a batch with other image and text prompts (other task splits, other chunks)."""
    from jaxllm import LLM

    llm = LLM(ckpt[0], dtype="float32", max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=32, block_size=4, batch_invariant=True)

    def run(prompts):
        return [(list(o.outputs[0].token_ids),
                 [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
                for o in llm.generate(prompts, _greedy(logprobs=2), use_tqdm=False)]

    target = {"prompt": TWO, "multi_modal_data": {"image": IMAGES}}
    alone = run([target])[0]
    others = [TEXT, {"prompt": gc.PROMPT, "multi_modal_data": {"image": IMAGES[1:]}}]
    assert run(others + [target])[-1] == alone
    assert run([others[1], target, others[0]])[1] == alone


def _two_prompts():
    return [{"prompt": gc.PROMPT, "multi_modal_data": {"image": IMAGES[0]}},
            {"prompt": TWO, "multi_modal_data": {"image": IMAGES}}]


@pytest.mark.slow
def test_tensor_parallel_2_equals_one_device(ckpt, llm):
    """Two virtual devices (the tower replicated, the decoder sharded, attend_to replicated):
    the same tokens."""
    from conftest import run_with_host_devices

    proc = run_with_host_devices(2, [__file__, ckpt[0]])
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tp2 == [list(o.outputs[0].token_ids)
                   for o in llm.generate(_two_prompts(), _greedy(), use_tqdm=False)]


if __name__ == "__main__":  # the tensor-parallel run (python this_file CHECKPOINT)
    from jaxllm import LLM

    tp_llm = LLM(sys.argv[1], dtype="float32", max_model_len=96, max_num_seqs=4,
                 max_num_batched_tokens=16, block_size=4, tensor_parallel_size=2)
    outs = tp_llm.generate(_two_prompts(), _greedy(), use_tqdm=False)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
