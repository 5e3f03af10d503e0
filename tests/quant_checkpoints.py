"""Tiny quantized checkpoints in compressed-tensors' on-disk layout, for loader tests.

`write_quantized` turns one of conftest's float checkpoints into what llm-compressor would
save: the quantization itself (min-max scales, packing, tensor names, the `quantization_config`
in config.json) is done by compressed-tensors' own code, so a loader tested against these files
meets the layout real checkpoints have, and transformers can load them as the oracle.

Why a mirror module tree instead of the transformers model: transformers 5 fuses MoE experts
into 3-D parameters (no `nn.Linear` per expert), while checkpoints keep one Linear per expert
(`...experts.3.w1.weight`). A tree of plain modules built from the checkpoint's keys gives every
projection its on-disk name, so compressed-tensors names and compresses each one as
llm-compressor does after it has unfused the experts.

What differs from a real llm-compressor run:
- weight qparams are plain min-max (llm-compressor's default "minmax" observer without GPTQ);
- the static fp8 `input_scale` comes from a forward pass of the float model over a fixed
  random batch (`_CALIB_TOKENS`): amax / 448, as its static min-max observer would give. Layers
  that batch cannot observe one by one (fused experts) get the largest scale seen anywhere;
- `w8a16` is per channel, as compressed-tensors' W8A16 preset was before 0.20 (whose preset
  is group 128: pass group_size=128 for that); both are "pack-quantized", 4 values an int32.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Iterable, Optional

import numpy as np

SCHEMES = ("w8a16", "w8a8", "fp8", "fp8-tensor", "w4a16")
# Routers stay float in every llm-compressor MoE recipe; they are Linear, so they need naming.
ROUTERS = ("re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*shared_expert_gate$")
_CALIB_TOKENS = (2, 48)  # batch, length of the random-token calibration batch (fp8-tensor)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# safetensors header dtypes -> torch names (what a loader sees after `safe_open(..., "pt")`)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def quant_scheme(scheme: str, group_size: Optional[int] = None, symmetric: bool = True):
    """The compressed-tensors scheme behind each name (targets ["Linear"], like the presets)."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationScheme,
                                                 preset_name_to_scheme)

    def int_weights(bits: int, default_group: Optional[int]):
        g = group_size if group_size is not None else default_group
        return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, dynamic=False,
                                strategy="channel" if g is None else "group", group_size=g)

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; one of {SCHEMES}")
    if scheme.startswith("fp8") and (group_size is not None or not symmetric):
        raise ValueError("fp8 schemes are symmetric, per channel (fp8) or per tensor")
    if scheme == "w8a16":
        return QuantizationScheme(targets=["Linear"], weights=int_weights(8, None))
    if scheme == "w4a16":
        return QuantizationScheme(targets=["Linear"], weights=int_weights(4, 128))
    if scheme == "w8a8":
        preset = preset_name_to_scheme("W8A8", ["Linear"])
        if group_size is None and symmetric:
            return preset
        return QuantizationScheme(targets=["Linear"], weights=int_weights(8, None),
                                  input_activations=preset.input_activations)
    return preset_name_to_scheme("FP8_DYNAMIC" if scheme == "fp8" else "FP8", ["Linear"])


def write_quantized(src_dir: str, dst_dir: str, scheme: str, *,
                    group_size: Optional[int] = None, symmetric: bool = True,
                    ignore: Iterable[str] = ("lm_head",), dtype: Optional[str] = None) -> str:
    """Quantize every decoder Linear of `src_dir` (not routers, embeddings or what `ignore`
    names, which takes compressed-tensors targets: names or "re:" patterns) into `dst_dir`.

    `group_size` switches int weights to the "group" strategy (w4a16 defaults to 128).
    `dtype` ("bfloat16", "float16") casts the float tensors first, as llm-compressor runs on a
    bf16 model and so writes bf16 scales; by default they keep the source's float32.
    """
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus,
                                                 apply_quantization_config)
    from safetensors.torch import save_file

    qscheme = quant_scheme(scheme, group_size, symmetric)
    state = _read_state(src_dir)
    if dtype is not None:
        cast = getattr(torch, dtype)
        state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    model = _mirror(state)
    config = QuantizationConfig(config_groups={"group_0": qscheme},
                                ignore=[*ignore, *ROUTERS])
    apply_quantization_config(model, config, show_progress=False)
    quantized = {name: m for name, m in model.named_modules()
                 if getattr(m, "quantization_scheme", None) is not None}
    if not quantized:
        raise ValueError(f"{src_dir}: no Linear left to quantize after ignore={config.ignore}")
    act = qscheme.input_activations
    in_amax = _input_amax(src_dir, quantized) if act is not None and not act.dynamic else {}
    for name, module in quantized.items():
        _calibrate(module, name, in_amax)
        module.quantization_status = QuantizationStatus.FROZEN

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    os.makedirs(dst_dir, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(src_dir):  # config, generation config, tokenizer files
        if f not in _WEIGHT_FILES and not f.endswith(".safetensors"):
            shutil.copy2(os.path.join(src_dir, f), os.path.join(dst_dir, f))
    if dtype is not None:
        _edit_json(os.path.join(dst_dir, "config.json"), dtype=dtype)
    compressor.update_config(dst_dir)  # writes quantization_config as llm-compressor does
    return dst_dir


def describe(dst_dir: str) -> dict[str, tuple[str, tuple]]:
    """name -> (torch dtype name, shape) of every tensor, read from the safetensors headers
    alone, so a loader author sees the layout without loading (or trusting) torch."""
    out: dict[str, tuple[str, tuple]] = {}
    for f in sorted(os.listdir(dst_dir)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(dst_dir, f), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (_DTYPES.get(info["dtype"], info["dtype"]), tuple(info["shape"]))
    return out


def quantization_config(dst_dir: str) -> dict:
    with open(os.path.join(dst_dir, "config.json")) as f:
        return json.load(f)["quantization_config"]


# --- internals --------------------------------------------------------------------------------

def _read_state(src_dir: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(src_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{src_dir}: no .safetensors weights")
    state: dict = {}
    for f in files:
        state.update(load_file(os.path.join(src_dir, f)))
    return state


def _mirror(state: dict):
    """Modules named as the checkpoint's keys: every 2-D `.weight` a Linear (with its bias),
    embeddings an Embedding (never a quantization target), the rest plain parameters."""
    from torch import nn

    def owner(path: str) -> nn.Module:
        mod = root
        for part in path.split(".") if path else ():
            if part not in dict(mod.named_children()):
                mod.add_module(part, nn.Module())
            mod = mod.get_submodule(part)
        return mod

    root = nn.Module()
    linears = {k[:-len(".weight")] for k, v in state.items()
               if k.endswith(".weight") and v.ndim == 2 and "embed" not in k}
    for key, value in state.items():
        path, _, leaf = key.rpartition(".")
        parent, _, child = path.rpartition(".")
        holder = owner(parent)
        if child not in dict(holder.named_children()):
            w = state.get(path + ".weight")
            if path in linears:
                mod = nn.Linear(w.shape[1], w.shape[0], bias=path + ".bias" in state,
                                device="meta")
            elif w is not None and w.ndim == 2:
                mod = nn.Embedding(*w.shape, device="meta")
            else:
                mod = nn.Module()
            holder.add_module(child, mod)
        setattr(holder.get_submodule(child), leaf, nn.Parameter(value, requires_grad=False))
    return root


def _calibrate(module, name: str, in_amax: dict) -> None:
    """Min-max qparams, reduced per strategy as compressed-tensors' observers reduce them."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = module.quantization_scheme
    with torch.no_grad():
        w, args = module.weight.float(), scheme.weights
        if args.strategy == "tensor":
            lo, hi = w.amin(), w.amax()
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        elif args.strategy == "group":
            if w.shape[-1] % args.group_size:
                raise ValueError(f"{name}: in_features {w.shape[-1]} not a multiple of "
                                 f"group_size {args.group_size}")
            g = w.unflatten(-1, (-1, args.group_size))
            lo, hi = g.amin(-1), g.amax(-1)
        else:
            raise ValueError(f"{name}: weight strategy {args.strategy!r} is not one this writer "
                             "makes (tensor, channel, group)")
        _set_qparams(module, "weight", *calculate_qparams(lo, hi, args))
        act = scheme.input_activations
        if act is not None and not act.dynamic:
            amax = in_amax.get(name, max(in_amax.values()))
            a = torch.tensor(amax, dtype=torch.float32)
            _set_qparams(module, "input", *calculate_qparams(-a, a, act))


def _set_qparams(module, base: str, scale, zero_point) -> None:
    target = getattr(module, f"{base}_scale")
    target.data.copy_(scale.reshape(target.shape))
    zp = getattr(module, f"{base}_zero_point", None)
    if zp is not None:
        zp.data.copy_(zero_point.reshape(zp.shape))


def _input_amax(src_dir: str, names: dict) -> dict[str, float]:
    """Largest |input| of each quantized Linear over the calibration batch, by checkpoint name;
    Linears that transformers fuses (MoE experts) are not observed here."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    amax: dict[str, float] = {}

    def hook(name):
        def fn(_mod, args):
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
               if n in names and isinstance(m, torch.nn.Linear)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, _CALIB_TOKENS, generator=g)
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    if not amax:
        raise ValueError(f"{src_dir}: no quantized Linear was observed in calibration")
    return amax


def _edit_json(path: str, **updates) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(updates)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


PROMPTS = [[1, 5, 9, 33, 70, 2, 8, 100], [4, 8, 15, 16, 23, 42]]


def assert_equals_oracle(model, oracle, greedy, new_tokens: int = 4) -> None:
    """A loaded jaxllm model's prefill logits and greedy tokens on PROMPTS against a
    transformers model: logits equal up to float32 summation order (2e-4 of the largest;
    quantization itself moves them about a thousand times more), tokens equal."""
    import torch

    prefill, _, tokens = greedy(model, PROMPTS, new_tokens)
    for p, got, toks in zip(PROMPTS, prefill, tokens):
        with torch.no_grad():
            want = oracle(torch.tensor([p])).logits[0].numpy()
            out = oracle.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)
        assert np.abs(got - want).max() < 2e-4 * np.abs(want).max()
        assert out[0, len(p):].tolist() == toks
