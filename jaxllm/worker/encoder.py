"""The encoder step of a vision-language model: before a step's forward, the vision tower runs
over the images whose placeholder tokens the step computes and were not encoded yet; their
embeddings are kept (keyed by the image's content hash) until no longer needed, so a prompt
prefilled in chunks, split before, inside or after an image, encodes each image once.

Each image runs as its own call: Qwen2.5-VL's and Qwen3-VL's over a power-of-two bucket of
patches (so a few programs serve every image size; each compiles on first use), Gemma 3's over
its one fixed image size. The embeddings (Qwen3-VL's with its deepstack features beside them)
come back to the host, where the step's input preparation places them at their tokens' rows
(jaxllm/worker/input_batch.py).

A prompt given as embeddings (--enable-prompt-embeds, on a text model too) takes the same road
with nothing to encode: its rows are placed at its tokens like an image's.
"""

from __future__ import annotations

from collections import OrderedDict

import jax
import numpy as np
from flax import nnx

from jaxllm.models import qwen3_vl
from jaxllm.models.qwen3_vl_spec import Qwen3VLVisionSpec
from jaxllm.models.qwen2_5_vl import vision_inputs
from jaxllm.models.vision_spec import Gemma3VisionSpec
from jaxllm.sequence import SchedulerOutput

MIN_PATCHES = 64  # the smallest patch bucket


class ImageEncoder:
    def __init__(self, graphdef, spec, dtype, cache_tokens: int = 1 << 16):
        """spec: the model's VisionSpec; cache_tokens: image tokens kept after encoding (the
        least recently used images go first; one needed again is encoded again)."""
        self.spec = spec
        self.dtype = dtype
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cached_tokens = 0
        self.images_encoded = 0  # tower calls so far (one per image not found in the cache)
        self._encode = jax.jit(
            lambda state, patches, inp: nnx.merge(graphdef, state).encode_images(patches, inp))

    @classmethod
    def of(cls, graphdef, model_config) -> "ImageEncoder | None":
        """The encoder of a vision-language model, or of a text model taking prompt
        embeddings (no tower: spec None); None for a text-only one."""
        if model_config.vision is None and not model_config.prompt_embeds:
            return None
        return cls(graphdef, model_config.vision, model_config.jnp_dtype)

    def _embeddings(self, state, pixels: np.ndarray, grid: tuple) -> np.ndarray:
        if isinstance(self.spec, Gemma3VisionSpec):  # one fixed-size image [C, S, S] a call
            out = self._encode(state, pixels[None], None)
            self.images_encoded += 1
            return np.asarray(out)[0].astype(self.dtype)
        n = len(pixels)
        N = max(MIN_PATCHES, 1 << (n - 1).bit_length())
        padded = np.zeros((N, pixels.shape[1]), np.float32)
        padded[:n] = pixels
        inputs = (qwen3_vl.vision_inputs if isinstance(self.spec, Qwen3VLVisionSpec)
                  else vision_inputs)
        out = self._encode(state, padded, inputs([grid], self.spec, N))
        self.images_encoded += 1
        return np.asarray(out)[:n // self.spec.merge_unit].astype(self.dtype)

    def _get(self, state, mm, k: int) -> np.ndarray:
        digest = mm.hashes[k]
        emb = self._cache.get(digest)
        if emb is None:
            emb = (mm.pixel_values[k].astype(self.dtype) if mm.given_embeds  # prompt embeds
                   else self._embeddings(state, mm.pixel_values[k], mm.grids[k]))
            self._cache[digest] = emb
            self._cached_tokens += len(emb)
            while self._cached_tokens > self.cache_tokens and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_tokens -= len(old)
        self._cache.move_to_end(digest)
        return emb

    def step_rows(self, sched: SchedulerOutput, state) -> dict[str, tuple]:
        """{seq_id: (prompt indices, embeddings [len, E])} of the image tokens each scheduled
        sequence computes in this step (its chunk [start, start + num_tokens))."""
        out = {}
        for it in sched.scheduled:
            mm = it.seq.mm
            if mm is None:
                continue
            a, b = it.start, it.start + it.num_tokens
            rows, embs = [], []
            for k, (s, n) in enumerate(zip(mm.starts, mm.num_tokens)):
                lo, hi = max(a, s), min(b, s + n)
                if lo < hi:
                    rows.append(np.arange(lo, hi))
                    embs.append(self._get(state, mm, k)[lo - s:hi - s])
            if rows:
                out[it.seq.seq_id] = (np.concatenate(rows), np.concatenate(embs))
        return out
