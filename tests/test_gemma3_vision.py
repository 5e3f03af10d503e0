"""Gemma 3 images (tiny random checkpoint, float32): the SigLIP tower and projector against
transformers, and `LLM.generate` / `LLM.chat` with images giving transformers' greedy tokens
and logprobs, with the image tokens attending to each other (its token_type_ids mask)."""

from __future__ import annotations

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


def test_chunk_never_ends_inside_an_image():
    """The scheduler's cut: before an image a chunk would end inside, or nothing when the
    chunk starts inside it (a prefix-cache hit) and cannot finish it; images too large for
    one step are refused."""
    from types import SimpleNamespace

    from jaxllm.engine.scheduler import Scheduler

    sched = Scheduler.__new__(Scheduler)
    sched.whole_images, sched.max_num_batched_tokens = True, 8
    seq = SimpleNamespace(mm=SimpleNamespace(starts=(5, 20), num_tokens=(4, 4)))
    assert sched._image_cut(seq, 0, 7) == 5    # would end inside image 1: stops before it
    assert sched._image_cut(seq, 0, 9) == 9    # ends right after it
    assert sched._image_cut(seq, 6, 2) == 0    # starts inside it, cannot finish it
    assert sched._image_cut(seq, 6, 3) == 3
    assert sched._image_cut(seq, 9, 13) == 11  # image 2 at 20..23: cut before it
    sched.whole_images = False
    assert sched._image_cut(seq, 0, 7) == 7


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
