"""MXFP4 expert weights as GPT-OSS publishes them: kept 4-bit (`kept_targets`), or
dequantized on the host as they arrive (`dequantized_experts`, with transformers' math in
`dequantize_mxfp4`): the CPU default, where the native grouped matmul takes float experts.

An MXFP4 tensor `W` [..., rows, cols] arrives as two: `W_blocks` uint8 [..., rows, cols/32,
16] (two 4-bit e2m1 values a byte, the low nibble first) and `W_scales` uint8 [..., rows,
cols/32] (an e8m0 power of two per 32 values, biased by 127). Each value is
e2m1[nibble] * 2 ** (scale - 127), exact in float32 and bfloat16; as transformers'
`convert_moe_packed_tensors`, the result is then transposed to the float checkpoint's
[..., cols, rows] (GPT-OSS's gate_up_proj [X, E, 2F], down_proj [X, F, E]).
"""

from __future__ import annotations

import numpy as np

from typing import Callable, Iterable, Iterator

from jaxllm.loader.quantized import Target

SUFFIXES = ("_blocks", "_scales")
# The e2m1 values of the 16 nibbles (sign, 2 exponent bits, 1 mantissa bit).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


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


def kept_targets(targets: dict, X: int, E: int, F: int) -> dict:
    """GPT-OSS's float targets with each layer's experts.gate_up_proj / down_proj replaced by
    their `_blocks` and `_scales` tensors, kept 4-bit as the model state holds them
    (`QuantizedWeight`'s MXFP4 form: q [X, in / 2, out...] with the nibbles along the input
    axis, scales [X, in / 32, out...]): the checkpoint's bytes transposed, and gate_up's
    interleaved gate/up rows separated into the [2, F] layout, as the float loader does."""
    def layouts(name):  # (blocks, scales) to_block of one layer's tensor
        if name == "gate_up_proj":  # [X, 2F (f, gate|up), G, 16] -> [X, E / 2, 2, F]
            return (lambda b: b.reshape(X, F, 2, E // 2).transpose(0, 3, 2, 1)[None],
                    lambda s: s.reshape(X, F, 2, E // 32).transpose(0, 3, 2, 1)[None],
                    (X, 2 * F, E // 32))
        return (lambda b: b.reshape(X, E, F // 2).transpose(0, 2, 1)[None],  # -> [X, F / 2, E]
                lambda s: s.transpose(0, 2, 1)[None], (X, E, F // 32))

    out = {}
    for name, ts in targets.items():
        proj = name.rsplit(".", 1)[-1]
        if ".mlp.experts." not in name or proj not in ("gate_up_proj", "down_proj"):
            out[name] = ts
            continue
        (t,) = ts
        blocks, scales, shape = layouts(proj)
        param = t.param[:-1] + (t.param[-1] + "_scale",)
        out[name + "_blocks"] = [Target(t.param, t.start, (*shape, 16), blocks, np.uint8)]
        out[name + "_scales"] = [Target(param, t.start, shape, scales, np.uint8)]
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
