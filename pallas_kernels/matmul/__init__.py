"""Few-row (decode) matmuls over stacked per-layer weights."""
