"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) over per-sequence state slots."""
