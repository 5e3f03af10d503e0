"""Host batch -> padded bucket arrays -> one jitted model step -> one jitted sampling step.

Two compiled functions, each over a small set of shapes known at start-up:
  forward(state, kv_cache, token_ids[T], positions[T], metadata) -> (hidden[T, E], kv_cache)
      T is a power-of-two token bucket; the metadata arrays have fixed sizes (max_num_seqs rows,
      the full block-table width), so nothing else changes shape. The cache is donated.
  sample(state, hidden, logits_indices[R], sampling tensors) -> sampled tokens (+ logprobs)
      R is a power-of-two bucket of the rows that sample this step.
Both are compiled at start-up (unless --enforce-eager); a compile after warm-up is counted,
logged, and raised when JAXLLM_FAIL_ON_RECOMPILE=1 (the tests set it).
The only device-to-host transfer per step is the sampler's output.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxllm.layers.attention import AttentionMetadata, KVCache, empty_kv_cache
from jaxllm.layers.sampler import SamplingTensors, sample, sampler_variants
from jaxllm.parallel.mesh import named_sharding

logger = logging.getLogger("jaxllm")

KV_CACHE_AXES = ("layers", "cache_blocks", "kv_heads", "cache_block_size", "head_dim")


def pow2_buckets(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class SampleResult:
    token: int
    logprob: Optional[float] = None
    rank: Optional[int] = None
    top: tuple = ()  # ((token_id, logprob), ...) best first


class ModelRunner:
    def __init__(self, model, model_config, mesh, *, num_blocks: int, block_size: int,
                 kv_cache_dtype, max_num_seqs: int, max_num_batched_tokens: int,
                 max_logprobs: int, enforce_eager: bool = False):
        self.model_config = model_config
        self.mesh = mesh
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_logprobs = max_logprobs
        self.enforce_eager = enforce_eager
        self.blocks_per_seq = math.ceil(model_config.max_model_len / block_size)
        self.token_buckets = pow2_buckets(1, max_num_batched_tokens)
        self.row_buckets = pow2_buckets(1, max_num_seqs)
        self.graphdef, self.state = nnx.split(model)
        mc = model_config
        shape = (mc.num_layers, num_blocks, mc.num_kv_heads, block_size, mc.head_dim)
        self.kv_cache: KVCache = empty_kv_cache(
            *shape, dtype=kv_cache_dtype, sharding=named_sharding(mesh, KV_CACHE_AXES, shape))
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,))
        self._sample = jax.jit(self._sample_fn)
        self._warm = False
        self._compiled = 0
        self.num_recompiles = 0

    # --- the jitted functions ----------------------------------------------------------------
    def _forward_fn(self, state, kv_cache, token_ids, positions, md):
        model = nnx.merge(self.graphdef, state)
        return model(kv_cache, token_ids, positions, md)

    def _sample_fn(self, state, hidden, logits_indices, tensors):
        model = nnx.merge(self.graphdef, state)
        return sample(model.compute_logits(hidden[logits_indices]), tensors)

    # --- host side ---------------------------------------------------------------------------
    def _prepare(self, sched) -> tuple:
        """Flat padded arrays for the scheduled requests (NumPy, no device work)."""
        items = sched.scheduled
        num_tokens = sum(it.num_tokens for it in items)
        T = num_tokens if self.enforce_eager else bucket(num_tokens, self.token_buckets)
        S, bs = self.max_num_seqs, self.block_size
        token_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        kv_lens = np.zeros(S, np.int32)
        tables = np.zeros((S, self.blocks_per_seq), np.int32)
        cu = np.zeros(S + 1, np.int32)
        rows, t = [], 0
        for i, it in enumerate(items):
            req, n, start = it.request, it.num_tokens, it.start
            token_ids[t:t + n] = _token_slice(req, start, n)
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[t:t + n] = pos
            blocks = np.asarray(it.block_ids, np.int32)
            slots[t:t + n] = blocks[pos // bs] * bs + pos % bs
            kv_lens[i] = start + n
            tables[i, :len(blocks)] = blocks
            t += n
            cu[i + 1] = t
            if it.sample:
                rows.append((req, t - 1))
        cu[len(items) + 1:] = t
        md = AttentionMetadata(slots, kv_lens, tables, cu, np.array([len(items)], np.int32))
        return token_ids, positions, md, rows

    def execute(self, sched) -> dict[str, SampleResult]:
        """Run one step; return the sampled token (and logprobs) of each request that samples."""
        token_ids, positions, md, rows = self._prepare(sched)
        hidden, self.kv_cache = self._forward(self.state, self.kv_cache, token_ids, positions, md)
        if not rows:
            self._check_compiles()
            return {}
        R = len(rows) if self.enforce_eager else bucket(len(rows), self.row_buckets)
        idx = np.zeros(R, np.int32)
        idx[:len(rows)] = [r[1] for r in rows]
        tensors = SamplingTensors.from_requests([r[0] for r in rows], pad_to=R,
                                                vocab_size=self.model_config.vocab_size,
                                                max_logprobs=self.max_logprobs)
        out = jax.device_get(self._sample(self.state, hidden, idx, tensors))
        self._check_compiles()
        return {req.request_id: _result(out, i, req) for i, (req, _) in enumerate(rows)}

    # --- compilation -------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile every token bucket and every (row bucket, sampler variant) now."""
        if self.enforce_eager:
            return
        S = self.max_num_seqs
        md_for = lambda T: AttentionMetadata(  # noqa: E731  (all padding: nothing is written)
            np.full(T, -1, np.int32), np.zeros(S, np.int32),
            np.zeros((S, self.blocks_per_seq), np.int32), np.zeros(S + 1, np.int32),
            np.zeros(1, np.int32))
        jobs = [("forward", T) for T in self.token_buckets]
        jobs += [("sample", R, v) for R in self.row_buckets for v in sampler_variants(self.max_logprobs)]
        hidden = None
        for job in tqdm(jobs, desc="Compiling buckets", unit="bucket", leave=False):
            if job[0] == "forward":
                T = job[1]
                z = np.zeros(T, np.int32)
                hidden, self.kv_cache = self._forward(self.state, self.kv_cache, z, z, md_for(T))
            else:
                _, R, variant = job
                tensors = SamplingTensors.dummy(R, self.model_config.vocab_size, variant)
                jax.block_until_ready(self._sample(self.state, hidden, np.zeros(R, np.int32),
                                                   tensors))
        jax.block_until_ready(self.kv_cache)
        self._compiled = self._num_compiled()
        self._warm = True
        logger.info("Compiled %d token buckets %s and %d sampler shapes", len(self.token_buckets),
                    self.token_buckets, len(jobs) - len(self.token_buckets))

    def _num_compiled(self) -> int:
        return self._forward._cache_size() + self._sample._cache_size()

    def _check_compiles(self) -> None:
        if not self._warm:
            return
        n = self._num_compiled()
        if n != self._compiled:
            self.num_recompiles += n - self._compiled
            self._compiled = n
            msg = "a step compiled after warm-up (a shape outside the buckets)"
            if os.environ.get("JAXLLM_FAIL_ON_RECOMPILE") == "1":
                raise RuntimeError(msg)
            logger.warning(msg)


def _token_slice(req, start: int, n: int) -> list[int]:
    """req.all_token_ids[start:start+n] without building the whole list for a decode token."""
    p = req.num_prompt_tokens
    if start >= p:
        return req.output_token_ids[start - p:start - p + n]
    if start + n <= p:
        return req.prompt_token_ids[start:start + n]
    return req.all_token_ids[start:start + n]


def _result(out, i: int, req) -> SampleResult:
    k = req.sampling_params.logprobs
    if k is None:
        return SampleResult(int(out.tokens[i]))
    top = tuple(zip(out.topk_ids[i, :k].tolist(), out.topk_logprobs[i, :k].tolist()))
    return SampleResult(int(out.tokens[i]), float(out.logprobs[i]), int(out.ranks[i]), top)
