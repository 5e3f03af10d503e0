"""GGUF's block-quantized layer projections kept quantized (issue 45), not dequantized at load.

Q8_0, Q4_0 and Q4_1 blocks (32 inputs of one output row each) are exactly `QuantizedWeight`'s
int8 or int4 values with one float32 scale, and for Q4_1 a zero point, per group of 32 inputs:
  Q8_0  w = d·q,  q int8                    -> values q, scale d
  Q4_0  w = d·(q - 8), q in 0..15           -> values q - 8, scale d
  Q4_1  w = d·q + m, q in 0..15             -> values q - 8, scale d, zero -8 - m/d
        (a block with d = 0 has every q = 0, llama.cpp's rounding: scale m, zero -9)
The model is kept quantized when every decoder projection has the same one of these types
(what llama.cpp's `--pure` files and the default SmolLM2 Q4_1 are); other files, and mixture-
of-experts ones, are dequantized at load as before.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from jaxllm.models.quant_config import GGUF_TYPES

# The block types kept quantized (their spec: models/quant_config.py); blocks of 32 inputs.
KEPT = GGUF_TYPES
BLOCK = 32
_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
_PROJECTION = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)"
                         r"\.weight")


def is_projection(name: str) -> bool:
    return _PROJECTION.fullmatch(name) is not None


def kept_type(tensors) -> Optional[str]:
    """The block type every decoder projection of a GGUF file shares, if it is one kept
    quantized (else None: the file is dequantized at load). Files with expert tensors are
    dequantized (their experts are other tensors)."""
    if any("_exps" in t.name or "_shexp" in t.name for t in tensors):
        return None
    types = {t.tensor_type.name for t in tensors if is_projection(t.name)}
    return types.pop() if len(types) == 1 and next(iter(types)) in KEPT else None


def decode(data: np.ndarray, kind: str, rows: int, inputs: int
           ) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """A projection's blocks -> (values int8 [rows, inputs], scale float32 [rows, groups],
    zero float32 [rows, groups] or None)."""
    raw = np.asarray(data, np.uint8).reshape(rows, inputs // BLOCK, _BYTES[kind])
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = np.ascontiguousarray(raw[..., 2:34]).view(np.int8)
        return q.reshape(rows, inputs), d, None
    qs = raw[..., 4:20] if kind == "Q4_1" else raw[..., 2:18]
    q = (np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int8) - 8).reshape(rows, inputs)
    if kind == "Q4_0":
        return q, d, None
    m = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    live = d != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(live, -8.0 - m / np.where(live, d, 1.0), -9.0).astype(np.float32)
    return q, np.where(live, d, m).astype(np.float32), zero
