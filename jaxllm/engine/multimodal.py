"""Images in a prompt, on the host: checked, preprocessed with the checkpoint's transformers
image processor (the PIL one here: torchvision does not import beside torch 2.13, and no video
processor is needed for images), hashed by content, and their placeholder tokens expanded.

A prompt names each image with one placeholder token (Qwen2.5-VL's `<|image_pad|>`, which its
chat template writes between `<|vision_start|>` and `<|vision_end|>`); it becomes as many
tokens as the image has merged patches. The result, an `ImageInputs`, rides on the request's
sequences: the runner encodes the pixels, the decoder reads the M-RoPE positions, and the
prefix cache keys the image tokens by the image's content hash.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import numpy as np

from jaxllm.config import ConfigError
from jaxllm.models.qwen2_5_vl import mrope_positions, num_image_tokens
from jaxllm.models.vision_spec import Gemma3VisionSpec
from jaxllm.sequence import ImageInputs

# Modalities a prompt's multi_modal_data may name; only images are implemented.
_NOT_IMPLEMENTED = ("video", "audio", "image_embeds")


def image_processor(config, model_config, tokenizer=None, refusal: Optional[str] = None,
                    max_step_tokens: Optional[int] = None) -> Optional["ImageProcessor"]:
    """A vision-language model's ImageProcessor (None for a text-only model): the checkpoint's
    transformers image processor (its preprocessor_config.json). tokenizer: the model's
    (Gemma 3 tokenizes the newlines around each image with it). refusal: why the runner takes
    no images (every prompt with images is refused with it). max_step_tokens: the tokens of
    one step (Gemma 3 computes an image's tokens in one step)."""
    if model_config.vision is None:
        return None
    from transformers import AutoImageProcessor

    if config.parallel.pipeline_parallel_size > 1:
        raise ConfigError(f"--pipeline-parallel-size: {model_config.architecture} with images "
                          "is not implemented with a pipeline")
    try:
        processor = AutoImageProcessor.from_pretrained(config.load.model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{model_config.architecture}: the checkpoint's image processor "
                          f"(preprocessor_config.json) does not load: {e}") from None
    limit = (config.model.limit_mm_per_prompt or {}).get("image")
    if isinstance(model_config.vision, Gemma3VisionSpec):
        images = Gemma3Images(processor, model_config.vision, limit, tokenizer)
        images.max_step_tokens = max_step_tokens
    else:
        images = ImageProcessor(processor, model_config.vision, limit)
    images.refusal = refusal
    return images


def image_hash(image) -> str:
    """The content hash of a PIL image: its mode, size and pixels (one pixel changes it)."""
    h = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def _key(digest: str) -> int:
    """An image's token key in the prefix cache's view of the prompt: negative (no real token
    id is), from its content hash."""
    return -1 - int(digest[:15], 16)


def prompt_embeds_inputs(value: Any, hidden_size: int, keep: Optional[int] = None
                         ) -> tuple[list[int], ImageInputs]:
    """A prompt given as embeddings (a NumPy, JAX or torch array [tokens, hidden size]; keep: its
    last k rows) as placeholder token ids and the ImageInputs that carry the rows to the step.
    The prefix cache keys its tokens by the embeddings' content hash. ValueError naming
    prompt_embeds for a bad array."""
    if hasattr(value, "detach"):  # a torch tensor (vLLM's type), read without importing torch
        value = value.detach().float().cpu().numpy()
    emb = np.asarray(value)
    if emb.ndim != 2 or emb.shape[0] < 1 or emb.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds must be an array [tokens, {hidden_size}] (the model's "
                         f"hidden size), got shape {list(emb.shape)}")
    if not np.issubdtype(emb.dtype, np.floating) and emb.dtype.name != "bfloat16":
        raise ValueError(f"prompt_embeds must be floating point, got {emb.dtype}")
    emb = emb.astype(np.float32)
    if keep is not None:
        emb = emb[-keep:]
    if not np.isfinite(emb).all():
        raise ValueError("prompt_embeds must be finite (no NaN or inf)")
    h = hashlib.sha256(f"embeds:{emb.shape}".encode())
    h.update(emb.tobytes())
    digest, n = h.hexdigest(), len(emb)
    return [0] * n, ImageInputs((emb,), ((),), (digest,), (0,), (n,), None, 0,
                                (_key(digest),) * n, given_embeds=True)


class ImageProcessor:
    """Images of one vision-language model: `expand` turns (token ids, images) into the
    expanded token ids and their `ImageInputs`."""

    def __init__(self, processor, spec, max_images: Optional[int] = None):
        """spec: the model's VisionSpec; max_images: --limit-mm-per-prompt's image count."""
        self.processor = processor
        # what a string-content chat template gets in place of an image part
        self.placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
        self.spec = spec
        self.max_images = max_images
        self.refusal: Optional[str] = None  # set: every prompt with images is refused with it
        self._cache: dict[str, tuple] = {}  # content hash -> (pixel values, grid), recent ones

    def images_of(self, data: Any) -> list:
        """The images of a prompt's multi_modal_data (an image or a list), checked."""
        from PIL import Image

        if self.refusal is not None:
            raise ValueError(self.refusal)
        if not isinstance(data, dict):
            raise ValueError("multi_modal_data must be a dict, e.g. {'image': PIL.Image}")
        for key in data:
            if key in _NOT_IMPLEMENTED:
                raise ValueError(f"multi_modal_data {key!r} is not supported (images only)")
            if key != "image":
                raise ValueError(f"unknown multi_modal_data key {key!r} (supported: 'image')")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        for i, im in enumerate(images):
            if not isinstance(im, Image.Image):
                raise ValueError(f"multi_modal_data image {i} is a {type(im).__name__}, not a "
                                 "PIL.Image")
        if self.max_images is not None and len(images) > self.max_images:
            raise ValueError(f"{len(images)} images in one prompt; at most {self.max_images} "
                             "are allowed (--limit-mm-per-prompt)")
        return images

    def _pixels(self, image, digest: str) -> tuple[np.ndarray, tuple]:
        hit = self._cache.get(digest)
        if hit is None:
            out = self.processor(images=[image], return_tensors="np")
            hit = (np.asarray(out["pixel_values"], np.float32),
                   tuple(int(x) for x in out["image_grid_thw"][0]))
            if len(self._cache) >= 64:
                self._cache.pop(next(iter(self._cache)))
            self._cache[digest] = hit
        return hit

    def expand(self, ids: list[int], images: list) -> tuple[list[int], ImageInputs]:
        """Each image's one placeholder token -> its merged-patch count of them."""
        tok = self.spec.image_token_id
        found = sum(1 for i in ids if i == tok)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image placeholder(s) (token {tok}) for "
                             f"{len(images)} image(s); put one placeholder per image (the chat "
                             "template does)")
        pixels, grids, hashes, starts, counts = [], [], [], [], []
        out, k = [], 0
        for t in ids:
            if t != tok:
                out.append(t)
                continue
            digest = image_hash(images[k])
            try:
                pv, grid = self._pixels(images[k].convert("RGB") if images[k].mode != "RGB"
                                        else images[k], digest)
            except Exception as e:  # an image the processor cannot take (aspect ratio...)
                raise ValueError(f"image {k}: the image processor refused it: {e}") from None
            n = num_image_tokens(grid, self.spec)
            pixels.append(pv)
            grids.append(grid)
            hashes.append(digest)
            starts.append(len(out))
            counts.append(n)
            out += [tok] * n
            k += 1
        positions, delta = mrope_positions(out, grids, self.spec)
        keyed = list(out)
        for digest, s, n in zip(hashes, starts, counts):
            keyed[s:s + n] = [_key(digest)] * n
        return out, ImageInputs(tuple(pixels), tuple(grids), tuple(hashes), tuple(starts),
                                tuple(counts), positions, delta, tuple(keyed))


class Gemma3Images(ImageProcessor):
    """Gemma 3's images in a prompt: transformers' Gemma 3 image processor (PIL path,
    pan-and-scan off, as vLLM's default) and Gemma3Processor's placeholder expansion, done on
    token ids.

    A prompt names each image with one `<start_of_image>`; it becomes the processor's
    "\\n\\n<start_of_image>" + mm_tokens_per_image soft tokens + "<end_of_image>\\n\\n". The
    processor tokenizes the expanded text, so the inserted newlines merge with the prompt's
    adjacent ones ("\\n" + "\\n\\n" is one "\\n\\n\\n" token in Gemma's vocabulary): every run of
    newline-only tokens is re-tokenized whole, as vLLM's Gemma 3 processor does.
    """

    def __init__(self, processor, spec, max_images, tokenizer):
        """spec: the model's Gemma3VisionSpec; tokenizer: the model's (Hugging Face)."""
        super().__init__(processor, spec, max_images)
        self.placeholder = "<start_of_image>"
        self.max_step_tokens: Optional[int] = None  # --max-num-batched-tokens (the engine's)
        self.tokenizer = tokenizer  # None with --skip-tokenizer-init: images are refused
        if tokenizer is not None:
            # newline-only tokens -> their newline count (Gemma's vocabulary spells them as is)
            self._newline = {i: len(t) for t, i in tokenizer.get_vocab().items()
                             if set(t) == {"\n"}}
            self._nn = tokenizer.encode("\n\n", add_special_tokens=False)

    def _pixels(self, image, digest: str) -> tuple[np.ndarray, tuple]:
        hit = self._cache.get(digest)
        if hit is None:
            out = self.processor(images=[image], do_pan_and_scan=False, return_tensors="np")
            hit = (np.asarray(out["pixel_values"], np.float32)[0], ())
            if len(self._cache) >= 64:
                self._cache.pop(next(iter(self._cache)))
            self._cache[digest] = hit
        return hit

    def _merge_newlines(self, ids: list[int], inserted: list[bool]) -> list[int]:
        """Each run of newline-only tokens holding an inserted one, tokenized whole."""
        out, i = [], 0
        while i < len(ids):
            j = i
            while j < len(ids) and ids[j] in self._newline:
                j += 1
            if j == i:
                out.append(ids[i])
                i += 1
            elif any(inserted[i:j]):
                out += self.tokenizer.encode("\n" * sum(self._newline[t] for t in ids[i:j]),
                                             add_special_tokens=False)
                i = j
            else:
                out += ids[i:j]
                i = j
        return out

    def expand(self, ids: list[int], images: list) -> tuple[list[int], ImageInputs]:
        """Each image's <start_of_image> -> the processor's full image sequence."""
        s = self.spec
        if self.tokenizer is None:
            raise ValueError("images need the model's tokenizer to expand their placeholders "
                             "(the engine was started with --skip-tokenizer-init)")
        if self.max_step_tokens is not None and s.mm_tokens_per_image > self.max_step_tokens:
            raise ValueError(f"an image is {s.mm_tokens_per_image} tokens, more than one step's "
                             f"--max-num-batched-tokens {self.max_step_tokens}: its tokens attend "
                             "to each other, so one step computes them all")
        found = sum(1 for i in ids if i == s.boi_token_id)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image placeholder(s) (<start_of_image>, "
                             f"token {s.boi_token_id}) for {len(images)} image(s); put one "
                             "placeholder per image (the chat template does)")
        pixels, hashes = [], []
        out, inserted, k = [], [], 0
        for t in ids:
            if t != s.boi_token_id:
                out.append(t)
                inserted.append(False)
                continue
            digest = image_hash(images[k])
            try:
                pv, _ = self._pixels(images[k].convert("RGB") if images[k].mode != "RGB"
                                     else images[k], digest)
            except Exception as e:  # an image the processor cannot take
                raise ValueError(f"image {k}: the image processor refused it: {e}") from None
            pixels.append(pv)
            hashes.append(digest)
            image = [s.boi_token_id] + [s.image_token_id] * s.mm_tokens_per_image \
                + [s.eoi_token_id]
            out += self._nn + image + self._nn
            inserted += [True] * (len(image) + 2 * len(self._nn))
            k += 1
        out = self._merge_newlines(out, inserted)
        n = s.mm_tokens_per_image
        starts = [i for i, t in enumerate(out) if t == s.image_token_id
                  and (i == 0 or out[i - 1] != s.image_token_id)]
        if len(starts) != len(images) or any(out[a:a + n] != [s.image_token_id] * n
                                             for a in starts):
            raise ValueError(f"the prompt's image soft tokens (token {s.image_token_id}) must "
                             "come only from its <start_of_image> placeholders")
        keyed = list(out)
        for digest, a in zip(hashes, starts):
            keyed[a:a + n] = [_key(digest)] * n
        return out, ImageInputs(tuple(pixels), ((),) * len(images), tuple(hashes),
                                tuple(starts), (n,) * len(images), None, 0, tuple(keyed))
