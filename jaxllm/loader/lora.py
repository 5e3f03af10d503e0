"""Reading a peft LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) into the
layout of the model's adapter slots (jaxllm/layers/lora.py), each module's scaling folded in.

What a slot cannot express is refused by name rather than dropped: DoRA, LoRA biases,
modules_to_save, adapters on the embedding or LM head, on MoE experts or a shared expert,
fan_in_fan_out (Conv1D) layouts, ranks above --max-lora-rank. lora_dropout only acts in
training and is not read.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from jaxllm.layers.lora import LORA_PROJECTIONS
from jaxllm.lora.request import LoRARequest
from jaxllm.loader import hf
from jaxllm.models.decoder import layer_groups
from jaxllm.models.model_config import ModelConfig

# peft module name -> (fused projection, its part)
MODULES = {m: (proj, i) for proj, ms in LORA_PROJECTIONS.items() for i, m in enumerate(ms)}
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.[\w-]+)?\.weight")
# adapter_config.json keys that change the computation and are not implemented
_REFUSED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
            "modules_to_save": "modules_to_save (fully trained copies of modules)",
            "target_parameters": "target_parameters (adapters on expert parameters)",
            "layer_replication": "layer_replication", "lora_bias": "lora_bias",
            "megatron_config": "megatron_config", "trainable_token_indices":
            "trainable_token_indices", "alora_invocation_tokens": "aLoRA"}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the reason."""


@dataclass
class Adapter:
    """One adapter in slot layout: {(layer group, projection): (A [L, in..., parts·R],
    B [L, R, out...])} in float32 (R --max-lora-rank), the projections it leaves alone absent
    (zeros)."""
    request: LoRARequest
    rank: int
    weights: dict

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(req: LoRARequest, cfg: ModelConfig) -> Adapter:
    """The adapter of `req` for the model `cfg` (built with LoRA slots: cfg.lora)."""
    where = f"LoRA adapter {req.lora_name!r} ({req.lora_path})"
    conf = _adapter_config(req.lora_path, where)
    files = [os.path.join(req.lora_path, "adapter_model.safetensors")]
    if not os.path.exists(files[0]):
        raise AdapterError(f"{where}: no adapter_model.safetensors (only safetensors adapters "
                           f"are read)")
    modules: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, array in hf.iter_weight_files(files, "safetensors", {}):
        m = _KEY.fullmatch(name)
        if m is None or m.group(3) not in MODULES:
            raise AdapterError(f"{where}: tensor {name!r} adapts a module jaxllm's slots do "
                               f"not cover (supported: {', '.join(MODULES)} of the decoder "
                               f"layers)")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        if layer >= cfg.num_layers:
            raise AdapterError(f"{where}: tensor {name!r} names layer {layer}; the model has "
                               f"{cfg.num_layers}")
        modules.setdefault((layer, module), {})[ab] = np.asarray(array, np.float32)
    if not modules:
        raise AdapterError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return Adapter(req, max(ab["A"].shape[0] for ab in modules.values() if "A" in ab),
                   _slot_weights(modules, conf, cfg, where))


def _adapter_config(path: str, where: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise AdapterError(f"{where}: no adapter_config.json (a peft adapter folder is needed)")
    with open(file) as f:
        conf = json.load(f)
    if conf.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {conf['peft_type']!r}; only LORA is served")
    for key, what in _REFUSED.items():
        if conf.get(key):
            raise AdapterError(f"{where}: {key} is set: {what} is not supported")
    if conf.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias={conf['bias']!r}: adapters with biases are not "
                           f"supported")
    return conf


def _scaling(conf: dict, layer: int, module: str, r: int) -> float:
    """lora_alpha / r, or / sqrt(r) with rsLoRA; alpha_pattern overrides alpha for the
    modules whose name ends with one of its keys (peft's rule)."""
    alpha = conf.get("lora_alpha", 8)
    section = "self_attn" if MODULES[module][0] in ("qkv", "o") else "mlp"
    name = f"model.layers.{layer}.{section}.{module}"
    for key, value in (conf.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{key}$", name):
            alpha = value
            break
    return alpha / (math.sqrt(r) if conf.get("use_rslora") else r)


def _slot_weights(modules: dict, conf: dict, cfg: ModelConfig, where: str) -> dict:
    E, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    K, G, R = cfg.num_kv_heads, cfg.q_per_kv, cfg.lora.max_lora_rank
    groups = layer_groups(cfg)
    out: dict = {}
    for (layer, module), ab in sorted(modules.items()):
        missing = {"A", "B"} - set(ab)
        if missing:
            raise AdapterError(f"{where}: layer {layer} {module} has no lora_{missing.pop()}")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        r = a.shape[0]
        if r > R:
            raise AdapterError(f"{where}: rank {r} (layer {layer} {module}) is above "
                               f"--max-lora-rank {R}")
        g = next(i for i, grp in enumerate(groups) if grp.first <= layer < grp.first + grp.count)
        proj, part = MODULES[module]
        if groups[g].kind == "moe" and proj in ("gate_up", "down"):
            raise AdapterError(f"{where}: layer {layer} {module}: adapters on a mixture-of-"
                               f"experts MLP are not supported (attention modules are)")
        b = b * _scaling(conf, layer, module, r)
        L, i = groups[g].count, layer - groups[g].first
        # the fused projection's input and output shapes, and this part's output width
        ins, outs, width = {"qkv": ((E,), (K, G + 2, D), K * (G if part == 0 else 1) * D),
                            "o": ((K, G, D), (E,), E), "gate_up": ((E,), (2, F), F),
                            "down": ((F,), (E,), E)}[proj]
        if a.shape[1] != math.prod(ins) or b.shape != (width, r):
            raise AdapterError(f"{where}: layer {layer} {module}: lora_A {a.shape} and lora_B "
                               f"{b.shape} do not fit the model's projection")
        at = a.reshape(r, *ins)
        at = np.moveaxis(at, 0, -1)  # [in..., r]
        bt = b.T  # [r, width]
        if proj == "qkv":
            bt = bt.reshape(r, K, -1, D)
        elif proj == "gate_up":
            bt = bt[:, None, :]
        parts = len(LORA_PROJECTIONS[proj])
        if (g, proj) not in out:
            out[(g, proj)] = (np.zeros((L, *ins, parts * R), np.float32),
                              np.zeros((L, R, *outs), np.float32))
        A, B = out[(g, proj)]
        A[i, ..., part * R:part * R + r] = at  # each part's own rank block of A
        if proj == "qkv":  # q heads, then k, then v, along the fused q_per_kv axis
            heads = slice(0, G) if part == 0 else slice(G + part - 1, G + part)
            B[i, :r, :, heads, :] = bt
        elif proj == "gate_up":
            B[i, :r, part:part + 1, :] = bt
        else:
            B[i, :r] = bt
    return out
