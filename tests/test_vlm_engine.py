"""Images through the engine (Qwen2.5-VL, tiny random checkpoint, float32): `LLM.generate`
with multi_modal_data and `LLM.chat` with image parts give transformers' greedy tokens, with
chunked prefill splitting prompts inside images, text-only requests beside image ones, and
prefix caching keyed by the image's content."""

from __future__ import annotations

import json
import sys

import pytest

import vlm_checkpoints as vc

TWO = vc.PROMPT.replace("Describe", "<|vision_start|><|image_pad|><|vision_end|>Describe")
TEXT = vc.PROMPT.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
IMAGES = [vc.image(0, 60, 90), vc.image(1, 130, 70)]  # 6 and 10 image tokens
NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))
    return path, vc.build(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    """Chunks of at most 16 tokens: a 2-image prompt is split inside its second image."""
    from jaxllm import LLM

    return LLM(ckpt[0], dtype="float32", max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=16, enable_prefix_caching=True, block_size=4)


def _reference(hf, text, images):
    tok = vc.tokenizer()
    px = vc.image_processor()(images=images, return_tensors="np") if images else None
    grids = px["image_grid_thw"] if px else []
    ids = vc.expand(tok.encode(text), grids, hf.config.image_token_id)
    tokens, logits = vc.hf_generate(hf, ids, px and px["pixel_values"], px and grids, NEW)
    _reference.logits[tuple(ids)] = logits
    return ids, tokens


_reference.logits = {}  # prompt ids -> transformers' logits at each generated position


def _greedy(logprobs=None):
    from jaxllm import SamplingParams

    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def test_batch_of_image_and_text_prompts_matches_transformers(ckpt, llm):
    """One image, two images of different sizes, text only: one batch, chunked prefill; the
    tokens and their logprobs."""
    hf = ckpt[1]
    cases = [(vc.PROMPT, IMAGES[:1]), (TWO, IMAGES), (TEXT, [])]
    refs = [_reference(hf, text, imgs) for text, imgs in cases]
    two_ids = refs[1][0]
    second = [i for i, t in enumerate(two_ids) if t == hf.config.image_token_id][6:]
    assert second[0] < 16 <= second[-1]  # the first 16-token chunk ends inside image 2
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
               for text, imgs in cases]
    import numpy as np
    import torch

    outs = llm.generate(prompts, _greedy(logprobs=0), use_tqdm=False)
    for (ids, tokens), out in zip(refs, outs):
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens
        ref = torch.log_softmax(torch.as_tensor(_reference.logits[tuple(ids)]), -1).numpy()
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        np.testing.assert_allclose(got, ref[np.arange(NEW), tokens], atol=2e-4)
    alone = llm.generate([prompts[1]], _greedy(), use_tqdm=False)[0]
    assert list(alone.outputs[0].token_ids) == refs[1][1]


def test_prefix_cache_is_keyed_by_the_image(ckpt, llm):
    """The same image again hits the cache past its tokens; one pixel changed misses it from
    the block holding the image's first token on, and gives that image's own tokens."""
    import numpy as np
    from PIL import Image

    hf = ckpt[1]
    image = vc.image(7, 90, 60)
    pixels = np.asarray(image).copy()
    pixels[30, 30, 0] ^= 1
    changed = Image.fromarray(pixels)
    ids, ref = _reference(hf, vc.PROMPT, [image])
    first_image_token = ids.index(hf.config.image_token_id)
    outs = [llm.generate({"prompt": vc.PROMPT, "multi_modal_data": {"image": im}}, _greedy(),
                         use_tqdm=False)[0] for im in (image, image, changed)]
    assert [list(o.outputs[0].token_ids) for o in outs[:2]] == [ref, ref]
    assert outs[1].num_cached_tokens > first_image_token + 6  # past the image's tokens
    assert outs[2].num_cached_tokens <= first_image_token  # only the text before it
    assert list(outs[2].outputs[0].token_ids) == _reference(hf, vc.PROMPT, [changed])[1]


def test_chat_with_image_parts(ckpt, llm):
    hf = ckpt[1]
    messages = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": IMAGES[1]},
        {"type": "text", "text": "Describe the image."}]}]
    out = llm.chat(messages, _greedy(), use_tqdm=False)[0]
    text = vc.tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": "Describe the image."}]}],
        tokenize=False, add_generation_prompt=True)
    ids, ref = _reference(hf, text, IMAGES[1:])
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == ref


def test_bad_image_inputs_are_refused_by_name(llm):
    from PIL import Image

    bad = [({"image": "not an image"}, "is a str, not a PIL.Image"),
           ({"video": IMAGES[0]}, "'video' is not supported"),
           ({"image_embeds": IMAGES[0]}, "'image_embeds' is not supported"),
           ({"image": IMAGES}, "1 image placeholder"),
           ({"image": Image.new("RGB", (5, 1200))}, "image 0: .*aspect ratio")]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt": vc.PROMPT, "multi_modal_data": data}, _greedy(),
                         use_tqdm=False)


@pytest.mark.slow
def test_tensor_parallel_2_equals_one_device(ckpt, llm):
    """Two virtual devices (the tower replicated, the decoder sharded): the same tokens."""
    from conftest import run_with_host_devices

    proc = run_with_host_devices(2, [__file__, ckpt[0]])
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tp2 == [list(o.outputs[0].token_ids) for o in llm.generate(_two_prompts(), _greedy(),
                                                                       use_tqdm=False)]


def _two_prompts():
    return [{"prompt": vc.PROMPT, "multi_modal_data": {"image": IMAGES[0]}},
            {"prompt": TWO, "multi_modal_data": {"image": IMAGES}}]


if __name__ == "__main__":  # the tensor-parallel run (python this_file CHECKPOINT)
    from jaxllm import LLM

    tp_llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, max_num_seqs=4,
                 max_num_batched_tokens=16, block_size=4, tensor_parallel_size=2)
    outs = tp_llm.generate(_two_prompts(), _greedy(), use_tqdm=False)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
