"""The quantized test checkpoints hold what compressed-tensors checkpoints hold, in its layout.

Three views of one checkpoint must agree: its files (names, dtypes, shapes, the config), an
independent NumPy decoding of them (written from the format, not from compressed-tensors'
code: it is the specification a loader implements), and transformers' own loading. The
decoded weights are checked against the float source (within half a quantization step), and
transformers' logits against a float model running the decoded weights (with the scheme's
activation quantization emulated): so a wrong bit order, offset or scale layout fails here
rather than in the loader's tests.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

from quant_checkpoints import describe, quantization_config, write_quantized

PROMPT = [[5, 17, 42, 99, 300, 511, 7, 250, 33, 128, 64, 1, 2, 3, 400, 77]]

# Max |logits - float logits| / std(float logits), measured on these tiny models (whose wide
# random weights make them far more sensitive than a trained model: noise of the size of
# int8's rounding, drawn at random, moves them by 0.16), with ~1.5x margin. Measured:
# w8a16 0.12, w8a16 g32 asym 0.10, qwen2_moe w8a16 0.18; w8a8 0.19; fp8 0.55; fp8-tensor 0.87;
# w4a16 g32 1.79, g32 asym 2.11, g128 (hidden 128) 1.96, mixtral g32 2.95. The tight check is
# the one against the decoded weights; this one catches a checkpoint that is not the model.
FLOAT_BOUND = {"w8a16": 0.3, "w8a8": 0.3, "fp8": 0.85, "fp8-tensor": 1.3, "w4a16": 4.5}
# transformers vs the NumPy-decoded weights in a float model: measured 0.0 (same float ops);
# a misread nibble order, offset or zero point moves it by 0.1 or more.
ORACLE_BOUND = 2e-3


# --- an independent decoder ----------------------------------------------------------------

def unpack_bits(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Rows of int32 words -> n unsigned `bits`-bit values per row. Each row is one
    little-endian bit stream: value i sits at bits [i*bits, (i+1)*bits) counting from bit 0 of
    word 0 (so for 4 bits, word j holds values 8j..8j+7, value 8j+k in bits 4k..4k+3)."""
    raw = np.ascontiguousarray(words.astype("<i4")).view(np.uint8)
    stream = np.unpackbits(raw, axis=-1, bitorder="little")[:, :n * bits]
    return (stream.reshape(len(words), n, bits).astype(np.int64) << np.arange(bits)).sum(-1)


def _per_column(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A tensor ([1]), channel ([out, 1]) or group ([out, in/g]) qparam, one per weight."""
    a = a.reshape(rows if a.size > 1 else 1, -1)
    return np.broadcast_to(np.repeat(a, cols // a.shape[1], axis=1), (rows, cols))


def decode(t: dict, prefix: str, weights: dict) -> np.ndarray:
    """The float weight a quantized Linear stands for: (q - zero_point) * scale."""
    bits = weights["num_bits"]
    if prefix + ".weight_packed" in t:
        rows, cols = (int(v) for v in t[prefix + ".weight_shape"])
        # stored unsigned: q + 2^(bits-1) (4-bit: q in [-8, 7] stored as 0..15)
        q = unpack_bits(t[prefix + ".weight_packed"].numpy(), bits, cols) - 2 ** (bits - 1)
    else:  # int8 or float8_e4m3fn, stored as is
        q = t[prefix + ".weight"].float().numpy()
        rows, cols = q.shape
    scale = _per_column(t[prefix + ".weight_scale"].float().numpy(), rows, cols)
    zp = 0
    if prefix + ".weight_zero_point" in t:  # packed along the output dim: [out*bits/32, G]
        z = t[prefix + ".weight_zero_point"].numpy()
        z = unpack_bits(z.T, bits, rows).T - 2 ** (bits - 1)  # signed, like q
        zp = _per_column(z.astype(np.float64), rows, cols)
    return ((q - zp) * scale).astype(np.float32)


def _half_step(t: dict, prefix: str, weights: dict, w: np.ndarray) -> np.ndarray:
    rows, cols = w.shape
    scale = _per_column(t[prefix + ".weight_scale"].float().numpy(), rows, cols)
    if weights["type"] == "float":  # e4m3: 3 mantissa bits; subnormal step 2^-9
        return np.maximum(np.abs(w) * 2.0 ** -4, scale * 2.0 ** -10)
    return scale / 2


# --- the checks --------------------------------------------------------------------------

def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _check_decoded(src: str, dst: str, tmp_path) -> tuple[str, set]:
    """Decodes every quantized Linear, checks it against the float weights and writes the
    decoded float checkpoint; returns it and the quantized modules' names."""
    import torch
    from safetensors.torch import save_file

    group = quantization_config(dst)["config_groups"]["group_0"]
    flt, q = _tensors(src), _tensors(dst)
    names = {k[:-len(".weight_scale")] for k in q if k.endswith(".weight_scale")}
    dense = dict(flt)
    for name in sorted(names):
        # the source as the quantizer saw it (cast to the scales' dtype when dtype= was used)
        w = flt[name + ".weight"].to(q[name + ".weight_scale"].dtype).float().numpy()
        got = decode(q, name, group["weights"])
        err = np.abs(got - w) - _half_step(q, name, group["weights"], w)
        assert err.max() <= 1e-6 * np.abs(w).max(), (name, float(err.max()))
        dense[name + ".weight"] = torch.from_numpy(got)
    # what is not quantized is the source's, untouched
    own = {n + s for n in names for s in (".weight", ".weight_packed", ".weight_shape",
                                           ".weight_scale", ".weight_zero_point", ".input_scale")}
    assert set(flt) - own == set(q) - own
    for k in set(q) - own:
        assert torch.equal(q[k], flt[k].to(q[k].dtype)), k
    out = tmp_path / "decoded"
    out.mkdir()
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out), names


def _act_quant(act: dict, input_scale):
    """compressed-tensors' input fake-quantization: symmetric, scale = amax / (range / 2)
    (int8: amax / 127.5; fp8: amax / 448), per token when dynamic."""
    import torch

    qmin, qmax, half = (-128, 127, 127.5) if act["type"] == "int" else (-448, 448, 448.0)

    def hook(_mod, args):
        x = args[0]
        s = x.abs().amax(-1, keepdim=True) / half if act["dynamic"] else input_scale.float()
        y = torch.clamp(x / s, qmin, qmax)
        y = torch.round(y) if act["type"] == "int" else y.to(torch.float8_e4m3fn).float()
        return (y * s,)

    return hook


def _logits(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT)).logits.float().numpy()


def _load(path: str, symmetric: bool = True):
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    # transformers 5.24 + compressed-tensors 0.20 cannot load packed zero points on the
    # default route (it builds unpacked [out, G] ones: llm-compressor#1618); the `dequantize`
    # route decompresses each module from the files, zero points included.
    extra = {} if symmetric else {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    with warnings.catch_warnings():  # "...the `quantization_config` from the model will be used"
        warnings.filterwarnings("ignore", "You passed `quantization_config`")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()


def check_against_transformers(src: str, dst: str, scheme: str, tmp_path,
                               symmetric: bool = True) -> tuple[float, float]:
    """(vs float, vs decoded) relative logits differences of transformers' load of `dst`."""
    decoded, names = _check_decoded(src, dst, tmp_path)
    ref = _logits(_load(src))
    got = _logits(_load(dst, symmetric))
    oracle = _load(decoded)
    act = quantization_config(dst)["config_groups"]["group_0"]["input_activations"]
    if act is not None and symmetric:  # the dequantize route does not quantize activations
        q = _tensors(dst)
        for n, m in oracle.named_modules():
            if n in names:
                m.register_forward_pre_hook(_act_quant(act, q.get(n + ".input_scale")))
    want = _logits(oracle)
    return (float(np.abs(got - ref).max() / ref.std()),
            float(np.abs(got - want).max() / want.std()))


# --- tests -----------------------------------------------------------------------------------

def _q_proj_layout(scheme, group_size, symmetric, out=64, inn=64, dt="float32"):
    """What llm-compressor writes for one [out, in] Linear."""
    q = "model.layers.0.self_attn.q_proj"
    cols = 1 if group_size is None else inn // group_size
    if scheme in ("w8a16", "w4a16"):
        bits = 8 if scheme == "w8a16" else 4
        lay = {q + ".weight_packed": ("int32", (out, inn * bits // 32)),
               q + ".weight_shape": ("int64", (2,)), q + ".weight_scale": (dt, (out, cols))}
        if not symmetric:
            lay[q + ".weight_zero_point"] = ("int32", (out * bits // 32, cols))
        return lay
    if scheme == "w8a8":
        return {q + ".weight": ("int8", (out, inn)), q + ".weight_scale": (dt, (out, 1))}
    if scheme == "fp8":
        return {q + ".weight": ("float8_e4m3fn", (out, inn)), q + ".weight_scale": (dt, (out, 1))}
    return {q + ".weight": ("float8_e4m3fn", (out, inn)), q + ".weight_scale": (dt, (1,)),
            q + ".input_scale": (dt, (1,))}


WEIGHTS = {  # quantization_config.config_groups.group_0.weights per case
    "w8a16": dict(num_bits=8, type="int", strategy="channel", group_size=None),
    "w8a8": dict(num_bits=8, type="int", strategy="channel", group_size=None),
    "fp8": dict(num_bits=8, type="float", strategy="channel", group_size=None),
    "fp8-tensor": dict(num_bits=8, type="float", strategy="tensor", group_size=None),
    "w4a16": dict(num_bits=4, type="int", strategy="group"),
}
ACTS = {"w8a8": dict(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True),
        "fp8": dict(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True),
        "fp8-tensor": dict(num_bits=8, type="float", strategy="tensor", dynamic=False,
                           symmetric=True, observer="static_minmax")}
FORMATS = {"w8a16": "pack-quantized", "w4a16": "pack-quantized", "w8a8": "int-quantized",
           "fp8": "float-quantized", "fp8-tensor": "float-quantized"}


@pytest.mark.parametrize("scheme,group_size,symmetric", [
    ("w8a16", None, True), ("w8a16", 32, False), ("w8a8", None, True), ("fp8", None, True),
    ("fp8-tensor", None, True), ("w4a16", 32, True), ("w4a16", 32, False)])
def test_llama_schemes(tiny_llama, tmp_path, scheme, group_size, symmetric):
    dst = write_quantized(tiny_llama, str(tmp_path / "q"), scheme, group_size=group_size,
                          symmetric=symmetric)
    cfg = quantization_config(dst)
    group = cfg["config_groups"]["group_0"]
    assert (cfg["quant_method"], cfg["format"], group["format"]) == (
        "compressed-tensors", FORMATS[scheme], FORMATS[scheme])
    assert cfg["quantization_status"] == "compressed" and cfg["ignore"] == ["lm_head"]
    assert group["targets"] == ["Linear"] and group["output_activations"] is None
    want_w = {**WEIGHTS[scheme], "symmetric": symmetric, "dynamic": False}
    if group_size is not None:
        want_w.update(strategy="group", group_size=group_size)
    assert {k: group["weights"][k] for k in want_w} == want_w
    acts = group["input_activations"]
    assert (acts and {k: acts[k] for k in ACTS[scheme]}) == ACTS.get(scheme)

    layout = describe(dst)
    want = _q_proj_layout(scheme, group_size, symmetric)
    assert {k: v for k, v in layout.items() if ".layers.0.self_attn.q_proj." in k} == want
    assert layout["lm_head.weight"] == ("float32", (512, 64))
    assert layout["model.embed_tokens.weight"] == ("float32", (512, 64))
    proj = {v[0] for k, v in layout.items() if k.endswith("proj.weight")}
    assert proj == ({"int8"} if scheme == "w8a8" else set() if scheme.startswith("w") else
                    {"float8_e4m3fn"})
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.exists(os.path.join(dst, f)), f

    vs_float, vs_decoded = check_against_transformers(tiny_llama, dst, scheme, tmp_path,
                                                      symmetric)
    print(f"{scheme} g{group_size} sym={symmetric}: vs float {vs_float:.4f}, "
          f"vs decoded {vs_decoded:.2e}")
    assert vs_decoded < ORACLE_BOUND
    assert 1e-4 < vs_float < FLOAT_BOUND[scheme]


def test_w4a16_group_128(make_tiny_checkpoint, tmp_path):
    """The preset's group size needs in_features a multiple of 128: a wider llama."""
    src = make_tiny_checkpoint("llama", seed=3, hidden_size=128, intermediate_size=256)
    dst = write_quantized(src, str(tmp_path / "q"), "w4a16")
    assert quantization_config(dst)["config_groups"]["group_0"]["weights"]["group_size"] == 128
    layout = describe(dst)
    assert {k: v for k, v in layout.items() if ".layers.0.self_attn.q_proj." in k} == \
        _q_proj_layout("w4a16", 128, True, out=128, inn=128)
    assert layout["model.layers.0.mlp.down_proj.weight_scale"] == ("float32", (128, 2))
    vs_float, vs_decoded = check_against_transformers(src, dst, "w4a16", tmp_path)
    print(f"w4a16 g128: vs float {vs_float:.4f}, vs decoded {vs_decoded:.2e}")
    assert vs_decoded < ORACLE_BOUND and 1e-4 < vs_float < FLOAT_BOUND["w4a16"]


@pytest.mark.parametrize("arch,scheme,group_size", [
    ("qwen2_moe", "w8a16", None), ("mixtral", "w4a16", 32)])
def test_moe(make_tiny_checkpoint, tmp_path, arch, scheme, group_size):
    """Experts and shared experts are quantized one Linear per expert, as on disk; the
    routers (and qwen2_moe's shared-expert gate) stay float and are listed in `ignore`."""
    src = make_tiny_checkpoint(arch, seed=1)
    dst = write_quantized(src, str(tmp_path / "q"), scheme, group_size=group_size)
    layout, cfg = describe(dst), quantization_config(dst)
    if arch == "qwen2_moe":  # layer 1 is dense (mlp_only_layers)
        routers = [f"model.layers.{i}.mlp.{g}" for i in (0, 2)
                   for g in ("gate", "shared_expert_gate")]
        quantized = ["model.layers.0.mlp.experts.7.down_proj",
                     "model.layers.2.mlp.shared_expert.gate_proj", "model.layers.1.mlp.up_proj"]
        want_scale = ("float32", (64, 1))  # down_proj: [hidden, 1] per channel
    else:
        routers = [f"model.layers.{i}.block_sparse_moe.gate" for i in (0, 1)]
        quantized = ["model.layers.0.block_sparse_moe.experts.7.w2",
                     "model.layers.1.block_sparse_moe.experts.0.w1"]
        want_scale = ("float32", (64, 1))  # w2: [hidden, 32 / 32]
    assert sorted(cfg["ignore"]) == sorted(["lm_head", *routers])
    for r in routers:
        assert layout[r + ".weight"][0] == "float32" and r + ".weight_scale" not in layout
    for m in quantized:
        assert m + ".weight_packed" in layout and m + ".weight" not in layout, m
    assert layout[quantized[0] + ".weight_scale"] == want_scale
    vs_float, vs_decoded = check_against_transformers(src, dst, scheme, tmp_path)
    print(f"{arch} {scheme}: vs float {vs_float:.4f}, vs decoded {vs_decoded:.2e}")
    assert vs_decoded < ORACLE_BOUND and 1e-4 < vs_float < FLOAT_BOUND[scheme]


def test_bf16_scales(tiny_llama, tmp_path):
    """llm-compressor quantizes a bf16 model: scales and unquantized tensors are bf16."""
    dst = write_quantized(tiny_llama, str(tmp_path / "q"), "fp8-tensor", dtype="bfloat16")
    layout = describe(dst)
    assert {k: v for k, v in layout.items() if ".layers.0.self_attn.q_proj." in k} == \
        _q_proj_layout("fp8-tensor", None, True, dt="bfloat16")
    assert layout["model.norm.weight"] == ("bfloat16", (64,))
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    vs_float, _ = check_against_transformers(tiny_llama, dst, "fp8-tensor", tmp_path)
    assert vs_float < FLOAT_BOUND["fp8-tensor"]


def test_unpack_bits_matches_the_format():
    """The decoder's bit order against hand-packed words: 4-bit values 0..15 stored with the
    +8 offset (q = -8..7), 8 to an int32 from the least significant nibble."""
    q = np.arange(-8, 8)
    u = q + 8
    words = [sum(int(u[8 * j + k]) << (4 * k) for k in range(8)) for j in range(2)]
    words = np.array([words], dtype=np.uint32).view(np.int32)
    assert (unpack_bits(words, 4, 16)[0] - 8 == q).all()


def test_rejects(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="unknown scheme"):
        write_quantized(tiny_llama, str(tmp_path / "a"), "int3")
    with pytest.raises(ValueError, match="not a multiple"):
        write_quantized(tiny_llama, str(tmp_path / "b"), "w4a16", group_size=128)
    with pytest.raises(ValueError, match="fp8"):
        write_quantized(tiny_llama, str(tmp_path / "c"), "fp8", symmetric=False)
