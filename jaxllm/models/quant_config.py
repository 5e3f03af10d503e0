"""A checkpoint's `quantization_config` and --quantization -> the model's `QuantSpec`.

As vLLM: the method is detected from config.json's `quantization_config`; --quantization NAME
forces an online method on a float checkpoint ('fp8': weights quantized to float8_e4m3fn per
output channel at load) or checks a quantized checkpoint's method. What a method or scheme asks
that is not implemented is refused by name, with what is supported.
"""

from __future__ import annotations

import re
from typing import Optional

from jaxllm.engine_config import QUANTIZATION_METHODS, ConfigError
from jaxllm.layers.quantization import QuantSpec

ONLINE_METHODS = {"fp8": "float8_e4m3fn"}
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq", "gguf", "mxfp4")
SUPPORTED = QUANTIZATION_METHODS
assert set(SUPPORTED) == {*CHECKPOINT_METHODS, *ONLINE_METHODS}
# compressed-tensors formats whose tensors the loader reads (weight-only dequantization).
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
# The decoder layers' projections, as Hugging Face names the modules (`ignore` and `targets`
# are matched against these; a projection left in float is not supported yet).
DENSE_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quant_spec(quant_config, requested: Optional[str]) -> Optional[QuantSpec]:
    """The QuantSpec of a checkpoint's `quantization_config` (a dict, or None for a float
    checkpoint) and --quantization (`requested`), or None for a float model."""
    if requested is not None and requested not in SUPPORTED:
        raise ConfigError(f"--quantization {requested!r} is not supported (supported: "
                          f"{', '.join(SUPPORTED)})")
    if quant_config is not None and not isinstance(quant_config, dict):
        quant_config = quant_config.to_dict()
    method = (quant_config or {}).get("quant_method")
    if method is None:
        if requested in CHECKPOINT_METHODS:
            raise ConfigError(f"--quantization {requested}: the checkpoint has no "
                              "quantization_config of that method")
        if requested is None:
            return None
        return QuantSpec(method=requested, weight_dtype=ONLINE_METHODS[requested])
    if requested is not None and requested != method:
        raise ConfigError(f"--quantization {requested}: the checkpoint is quantized with "
                          f"{method!r}")
    if method not in CHECKPOINT_METHODS:
        raise ConfigError(f"quantization method {method!r} (the checkpoint's "
                          f"quantization_config) is not supported; supported: "
                          f"{', '.join(SUPPORTED)}")
    return {"compressed-tensors": compressed_tensors_spec, "gptq": gptq_spec,
            "awq": awq_spec, "gguf": gguf_spec, "mxfp4": mxfp4_spec}[method](quant_config)


# GGUF block types kept quantized (jaxllm/loader/gguf_quant.py): (weight dtype, symmetric)
GGUF_TYPES = {"Q8_0": ("int8", True), "Q4_0": ("int4", True), "Q4_1": ("int4", False)}


def gguf_spec(qc: dict) -> QuantSpec:
    """A GGUF file whose decoder projections all have one block type (the loader's
    quantization_config for it): blocks of 32 inputs, a scale each (and Q4_1's zero)."""
    kind = qc.get("weight_type")
    if kind not in GGUF_TYPES:
        raise ConfigError(f"GGUF block type {kind!r} is not kept quantized (kept: "
                          f"{', '.join(GGUF_TYPES)})")
    dtype, symmetric = GGUF_TYPES[kind]
    return QuantSpec("gguf", dtype, group_size=32, symmetric=symmetric, checkpoint_format=kind)


def compressed_tensors_spec(qc: dict) -> Optional[QuantSpec]:
    """llm-compressor's config: one scheme for every decoder projection (weights int8, int4
    or float8 per channel, per tensor or per group; activations dynamic or static, not
    quantized here); None for a config with only a kv_cache_scheme (float weights)."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"compressed-tensors checkpoint: {what} is not supported (supported: "
                           f"formats {', '.join(CT_FORMATS)}; int8, int4 or float8 weights per "
                           "channel, tensor or group)")

    if qc.get("kv_cache_scheme"):
        check_kv_cache_scheme(qc["kv_cache_scheme"])
        if not qc.get("config_groups"):  # KV scales only: the weights are float
            return None
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        raise refuse(f"format {fmt!r}")
    if qc.get("transform_config"):
        raise refuse("transform_config")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise refuse(f"sparsity format {sparsity.get('format')!r}")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise refuse("a config without config_groups")
    weights = [g.get("weights") or {} for g in groups]
    if any(w != weights[0] for w in weights[1:]):
        raise refuse("several weight schemes in one model")
    for g in groups:
        if g.get("format") not in (None, fmt):
            raise refuse(f"mixed formats ({fmt!r} and {g.get('format')!r})")
        if g.get("output_activations"):
            raise refuse("output_activations quantization")
    covered = [n for n in DENSE_PROJECTIONS
               if any(_matches(n, g.get("targets") or ()) for g in groups)]
    if len(covered) != len(DENSE_PROJECTIONS):
        raise refuse("a checkpoint whose layer projections are not all quantized "
                     f"({', '.join(sorted(set(DENSE_PROJECTIONS) - set(covered)))} left out)")
    ignored = [n for n in DENSE_PROJECTIONS if _matches(n, qc.get("ignore") or ())]
    if ignored:
        raise refuse(f"ignore entries naming layer projections ({', '.join(ignored)})")

    w = weights[0]
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    dtype = {(8, "int"): "int8", (4, "int"): "int4", (8, "float"): "float8_e4m3fn"}.get(
        (bits, kind))
    if dtype is None:
        raise refuse(f"{bits}-bit {kind} weights")
    if strategy not in ("channel", "tensor", "group"):
        raise refuse(f"weight strategy {strategy!r}")
    if w.get("actorder") == "group":
        raise refuse("actorder 'group' (activation-ordered groups, a g_idx per weight)")
    if w.get("dynamic"):
        raise refuse("dynamic weight quantization")
    symmetric = bool(w.get("symmetric", True))
    if dtype == "float8_e4m3fn" and not symmetric:
        raise refuse("asymmetric float8 weights")
    acts = [g.get("input_activations") for g in groups]
    activations = ("none" if not any(acts) else
                   "dynamic" if all(a and a.get("dynamic") for a in acts) else "static")
    return QuantSpec(method="compressed-tensors", weight_dtype=dtype,
                     group_size=int(w["group_size"]) if strategy == "group" else None,
                     symmetric=symmetric, activations=activations, checkpoint_format=fmt)


def check_kv_cache_scheme(scheme: dict) -> None:
    """compressed-tensors' kv_cache_scheme: static float8 per-tensor scales, one k_scale and
    one v_scale per layer (read with --kv-cache-dtype fp8, jaxllm/loader/kv_scales.py; an
    'auto' cache ignores them, as vLLM)."""
    got = (scheme.get("num_bits"), scheme.get("type"), scheme.get("strategy") or "tensor",
           bool(scheme.get("dynamic")), bool(scheme.get("symmetric", True)))
    if got != (8, "float", "tensor", False, True):
        raise ConfigError(f"compressed-tensors checkpoint: kv_cache_scheme {scheme!r} is not "
                          "supported (supported: 8-bit float, strategy tensor, static, "
                          "symmetric: one k_scale and v_scale per layer)")


def gptq_spec(qc: dict) -> QuantSpec:
    """AutoGPTQ / GPTQModel checkpoints: 4- or 8-bit integers packed along the input axis
    (`qweight`), zero points along the output axis (`qzeros`; stored minus one in the v1
    format), `scales` per group of inputs, `g_idx` (trivial without activation order)."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"gptq checkpoint: {what} is not supported (supported: 4 or 8 bits, "
                           "desc_act false, checkpoint_format gptq or gptq_v2)")

    bits = qc.get("bits")
    if bits not in (4, 8):
        raise refuse(f"bits {bits!r}")
    if qc.get("desc_act"):
        raise refuse("desc_act true (activation order: each weight's groups follow g_idx)")
    fmt = qc.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"checkpoint_format {fmt!r}")
    for key in ("dynamic", "modules_in_block_to_quantize"):
        if qc.get(key):
            raise refuse(f"{key} (per-module settings)")
    group = qc.get("group_size", -1)
    return QuantSpec(method="gptq", weight_dtype="int4" if bits == 4 else "int8",
                     group_size=None if group in (-1, None) else int(group),
                     symmetric=bool(qc.get("sym", True)), checkpoint_format=fmt)


def awq_spec(qc: dict) -> QuantSpec:
    """AutoAWQ's GEMM checkpoints: 4-bit integers packed along the output axis in AWQ's
    interleaved order, zero points likewise, `scales` per group of inputs."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"awq checkpoint: {what} is not supported (supported: 4 bits, "
                           "version gemm, with zero points)")

    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise refuse(f"bits {bits!r}")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(f"version {version!r}")
    if not qc.get("zero_point", True):
        raise refuse("zero_point false")
    skipped = [n for n in DENSE_PROJECTIONS
               if any(m in f"model.layers.0.{n}" for m in qc.get("modules_to_not_convert") or ())]
    if skipped:
        raise refuse(f"modules_to_not_convert naming layer projections ({', '.join(skipped)})")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    return QuantSpec(method="awq", weight_dtype="int4",
                     group_size=None if group in (-1, None) else int(group), symmetric=False,
                     checkpoint_format="gemm")


def _matches(module: str, patterns) -> bool:
    """Whether a projection (e.g. 'self_attn.q_proj' of any layer) is named by compressed-tensors
    targets/ignore: a class name ('Linear'), a 're:' regular expression, or a module name."""
    name = f"model.layers.0.{module}"
    for p in patterns:
        if p == "Linear":
            return True
        if p.startswith("re:"):
            if re.match(p[3:], name) or re.match(p[3:], module):
                return True
        elif p == name or name.endswith("." + p) or p == module:
            return True
    return False


def mxfp4_spec(qc: dict) -> QuantSpec:
    """OpenAI's MXFP4 checkpoints (GPT-OSS): the MoE experts as e2m1 blocks with an e8m0 scale
    per 32 inputs, kept so (`pallas_kernels.grouped_matmul.mxfp4`); every other projection
    is float (`modules_to_not_convert` names them)."""
    kept = [m for m in qc.get("modules_to_not_convert") or () if "experts" in m]
    if kept:
        raise ConfigError(f"mxfp4 checkpoint: modules_to_not_convert naming the experts "
                          f"({', '.join(kept)}) is not supported (supported: MXFP4 experts, "
                          "every other projection float)")
    return QuantSpec("mxfp4", "mxfp4", group_size=32, experts_only=True)
