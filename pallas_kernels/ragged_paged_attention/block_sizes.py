"""Block sizes of the Pallas ragged paged-attention kernels, in one place.

TABLE maps (head_dim, page_size) -> (queries per block, pages per step) per variant. The entries
are starting points sized from on-chip memory budgets, not measurements: they are untuned on
a TPU or GPU (scripts/bench_attention.py tunes them on one).
  tpu: ~512 keys per step for head_dim <= 128 (K+V double buffers of 512 KiB in bf16, far
       below the scoped VMEM), ~256 for head_dim 256; 32 query tokens per block.
  gpu: ~64-128 keys per step so that K and V tiles fit shared memory with 2 pipeline stages;
       16 query tokens per block.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

TABLE = {
    "tpu": {
        (64, 16): (32, 32), (64, 32): (32, 16), (64, 64): (32, 8), (64, 128): (32, 4),
        (128, 16): (32, 32), (128, 32): (32, 16), (128, 64): (32, 8), (128, 128): (32, 4),
        (256, 16): (16, 16), (256, 32): (16, 8), (256, 64): (16, 4), (256, 128): (16, 2),
    },
    "gpu": {
        (64, 16): (16, 8), (64, 32): (16, 4), (64, 64): (16, 2), (64, 128): (16, 1),
        (128, 16): (16, 4), (128, 32): (16, 2), (128, 64): (16, 1), (128, 128): (16, 1),
        (256, 16): (16, 2), (256, 32): (16, 1), (256, 64): (16, 1), (256, 128): (16, 1),
    },
}
# Fallback for a (head_dim, page_size) pair missing from TABLE: queries, keys per step.
DEFAULT = {"tpu": (32, 512), "gpu": (16, 64)}
# Rows (query tokens x query heads) of a q tile must be a multiple of this: the bf16 sublane
# tile on TPU; the smallest M of a Triton dot on GPU.
MIN_ROWS = {"tpu": 16, "gpu": 16}
# Triton dots also need K >= 16: the GPU variant pads smaller or non-power-of-2 head dims.
GPU_MIN_HEAD_DIM = 16
# Triton launch parameters of the GPU variant.
GPU_NUM_WARPS = 4
GPU_NUM_STAGES = 2


class Blocks(NamedTuple):
    queries: int  # query tokens per grid step
    group: int    # q rows per token and kv head: the GQA group (the GPU pads it to a power of 2)
    pages: int    # KV pages per online-softmax step


def pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def choose(variant: str, *, head_dim: int, page_size: int, group: int, max_q_len: int,
           table_width: int, queries: Optional[int] = None,
           pages: Optional[int] = None) -> Blocks:
    """Block sizes for one call; `queries`/`pages` override the table (tests, tuning).

    Fewer queries per block when no sequence has that many this step (decode), and never more
    pages per step than a block table holds.
    """
    tq, tp = TABLE[variant].get((head_dim, page_size), (None, None))
    if tq is None:
        tq, keys = DEFAULT[variant]
        tp = max(1, keys // page_size)
    queries = queries or min(tq, pow2_ceil(max_q_len))
    pages = max(1, min(pages or tp, table_width))
    rows = MIN_ROWS[variant]
    if variant == "gpu":  # Triton tiles are powers of 2
        queries, pages = pow2_ceil(queries), _pow2_floor(pages)
        group = max(pow2_ceil(group), -(-rows // queries))
    else:
        step = rows // math.gcd(group, rows)
        queries = -(-queries // step) * step
    return Blocks(queries, group, pages)
