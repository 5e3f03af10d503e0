"""Grouped (per-expert) matmuls over stacked packed expert weights."""
