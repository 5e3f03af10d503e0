"""MXFP4 expert weights as GPT-OSS publishes them, dequantized at load.

An MXFP4 tensor `W` [..., rows, cols] arrives as two: `W_blocks` uint8 [..., rows, cols/32,
16] (two 4-bit e2m1 values a byte, the low nibble first) and `W_scales` uint8 [..., rows,
cols/32] (an e8m0 power of two per 32 values, biased by 127). Each value is
e2m1[nibble] * 2 ** (scale - 127), exact in float32 and bfloat16; as transformers'
`convert_moe_packed_tensors`, the result is then transposed to the float checkpoint's
[..., cols, rows] (GPT-OSS's gate_up_proj [X, E, 2F], down_proj [X, F, E]), so the loader's
float layouts take it from there.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np

# The e2m1 values of the 16 nibbles (sign, 2 exponent bits, 1 mantissa bit).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """blocks uint8 [..., rows, G, 16] and scales uint8 [..., rows, G] -> [..., G * 32, rows]
    in `dtype` (transposed, as transformers returns it). Computed in float32 one expert (one
    index of the leading axes) at a time, so the host holds a float32 copy of one expert, not
    of the whole tensor; every value is exact in float32 and bfloat16."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.ndim < 3 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not fit scales {scales.shape} "
                         "(want blocks [..., rows, G, 16] for scales [..., rows, G])")
    *lead, rows, groups, _ = blocks.shape
    out = np.empty((*lead, groups * 32, rows), dtype)
    for i in np.ndindex(*lead):
        b, s = blocks[i], scales[i]
        values = np.empty((rows, groups, 32), np.float32)
        values[..., 0::2] = E2M1[b & 0x0F]
        values[..., 1::2] = E2M1[b >> 4]
        values = np.ldexp(values, s.astype(np.int32)[..., None] - 127)
        out[i] = values.reshape(rows, groups * 32).T
    return out


def dequantized_experts(tensors: Iterable, origin: Callable[[str], str], error: type,
                        dtype=np.float32) -> Iterator[tuple[str, np.ndarray]]:
    """The (name, array) stream with each `W_blocks` / `W_scales` pair replaced by W
    dequantized to `dtype` (`dequantize_mxfp4`; the model's, so it is not cast again),
    yielded once both halves have arrived (in either order); other tensors pass through. A
    half whose partner never comes raises `error`."""
    pending: dict[str, tuple[str, np.ndarray]] = {}
    for name, array in tensors:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, array
            continue
        base = name[:-len(suffix)]
        if base not in pending:
            pending[base] = (suffix, array)
            continue
        other_suffix, other = pending.pop(base)
        if other_suffix == suffix:
            raise error(f"{origin(name)}: tensor {name!r} appears twice")
        blocks, scales = (array, other) if suffix == "_blocks" else (other, array)
        try:
            yield base, dequantize_mxfp4(blocks, scales, dtype)
        except ValueError as e:
            raise error(f"{origin(name)}: {base}: {e}") from e
    if pending:
        base, (suffix, _) = next(iter(pending.items()))
        missing = base + ("_scales" if suffix == "_blocks" else "_blocks")
        raise error(f"{origin(base + suffix)}: MXFP4 tensor {missing!r} is missing (its "
                    f"{base + suffix!r} is there)")
