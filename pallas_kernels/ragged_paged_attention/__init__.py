"""Attention over a block-table (paged) KV cache for a flat ragged batch of tokens."""

from pallas_kernels.ragged_paged_attention.reference import (  # noqa: F401
    ragged_paged_attention as ref_ragged_paged_attention,
    write_kv,
)
