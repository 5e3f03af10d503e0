"""Hugging Face tensors -> the decoder's stacked, fused, sharded parameters.

Each parameter is allocated once on the devices with its sharding; every incoming tensor is
transposed/fused on the host and written into its slice by a jitted in-place (donated) update.
So tensors may arrive in any order (safetensors, `.bin` or GGUF), and host memory holds about
one tensor at a time: the model is never materialized twice.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxllm.loader import gemma4_weights, qwen3_next_weights
from jaxllm.loader.mxfp4 import dequantized_experts, kept_targets
from jaxllm.loader.kv_scales import is_kv_scale, kv_scale_targets, missing_layers, warn_missing
from jaxllm.models.kv_scales import FROM_CHECKPOINT
from jaxllm.loader.text_names import TEXT_NAMES
from jaxllm.loader.quantized import Target, quantized_targets, storage_cast
from jaxllm.models.decoder import MOE_KINDS, Decoder, layer_groups
from jaxllm.models.llama4 import deinterleave_rows
from jaxllm.models.model_config import ModelConfig
from jaxllm.models import gemma3_vision, qwen3_vl
from jaxllm.models.qwen3_vl_spec import Qwen3VLVisionSpec
from jaxllm.models.vision_spec import Gemma3VisionSpec
from jaxllm.models.qwen2_5_vl import vision_targets
from jaxllm.parallel.mesh import named_sharding

# Tensors some checkpoints carry that the model recomputes or never needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A sequence classifier's head: the pooling runner reads it (jaxllm/loader/classifier_head.py).
HEAD_PREFIXES = ("score.",)
# Parameters kept in float32 whatever the model's dtype when `router_f32` (DeepSeek's gate).
F32_PARAMS = ("router", "router_bias")


class CheckpointError(ValueError):
    """A weight file that is unreadable or does not fit the model; names the file and tensor."""


def hf_targets(cfg: ModelConfig) -> dict[str, list[Target]]:
    """Every tensor name a checkpoint of this model must provide, and where it goes (a
    quantized model's projection tensors: `quantized_targets`)."""
    if cfg.gemma4 is not None:  # per-layer-type geometry (jaxllm/loader/gemma4_weights.py)
        return gemma4_weights.targets(cfg)
    targets = _float_targets(cfg)
    if cfg.vision is not None:
        targets.update(_vision_targets(cfg))
    mxfp4 = cfg.quant is not None and cfg.quant.method == "mxfp4"
    if cfg.architecture in FUSED_LAYOUTS or cfg.architecture in MOE_LAYOUTS:
        if cfg.quant is not None and not mxfp4:
            raise CheckpointError(f"quantized {cfg.architecture} checkpoints (fused or stacked "
                                  "projections) are not supported")
    if cfg.architecture in FUSED_LAYOUTS:
        targets = _fused(targets, cfg, FUSED_LAYOUTS[cfg.architecture])
    if cfg.kv_scales == FROM_CHECKPOINT:  # optional: a layer without them keeps 1.0
        targets.update(kv_scale_targets(layer_groups(cfg)))
    if cfg.quant is None:
        return targets
    if mxfp4:  # GPT-OSS's experts, kept 4-bit
        return kept_targets(targets, cfg.num_experts, cfg.hidden_size,
                            cfg.moe_intermediate_size)
    return quantized_targets(targets, cfg.quant, (cfg.num_kv_heads, cfg.head_dim))


def _float_targets(cfg: ModelConfig) -> dict[str, list[Target]]:
    V, E, F, D = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    K, G = cfg.num_kv_heads, cfg.q_per_kv
    same = lambda x: x  # noqa: E731
    out = {"model.embed_tokens.weight": [Target(("embed",), (0, 0), (V, E), same)],
           "model.norm.weight": [Target(("final_norm",), (0,), (E,), same)]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [Target(("lm_head",), (0, 0), (V, E), same)]

    # [out, in] HF layouts -> the fused layouts of `Layers` (leading layer axis added below)
    def heads_in(n):  # [n*D, E] -> [E, K, n, D]
        return lambda x: x.reshape(K, n, D, E).transpose(3, 0, 1, 2)

    def bias_in(n):  # [n*D] -> [K, n, D]
        return lambda x: x.reshape(K, n, D)

    def gate_up(x):  # [F, E] -> [E, 1, F]
        return x.T[:, None, :]

    per_layer = [
        ("input_layernorm.weight", "attn_norm", (0,), (E,), same),
        ("self_attn.q_proj.weight", "qkv", (0, 0, 0, 0), (K * G * D, E), heads_in(G)),
        ("self_attn.k_proj.weight", "qkv", (0, 0, G, 0), (K * D, E), heads_in(1)),
        ("self_attn.v_proj.weight", "qkv", (0, 0, G + 1, 0), (K * D, E), heads_in(1)),
        ("self_attn.o_proj.weight", "o", (0, 0, 0, 0), (E, K * G * D),
         lambda x: x.reshape(E, K, G, D).transpose(1, 2, 3, 0)),
    ]
    if cfg.qkv_bias:
        per_layer += [("self_attn.q_proj.bias", "qkv_bias", (0, 0, 0), (K * G * D,), bias_in(G)),
                      ("self_attn.k_proj.bias", "qkv_bias", (0, G, 0), (K * D,), bias_in(1)),
                      ("self_attn.v_proj.bias", "qkv_bias", (0, G + 1, 0), (K * D,), bias_in(1))]
    if cfg.o_bias:
        per_layer.append(("self_attn.o_proj.bias", "o_bias", (0,), (E,), same))
    if cfg.nope_layers:  # Llama 4's (even, odd) rotary pairs -> apply_rope's (i, i + D/2)
        per_layer = [(name, param, start, shape,
                      lambda x, fn=fn, n=shape[0] // D: fn(deinterleave_rows(x, n, D)))
                     if name.startswith(("self_attn.q_proj.", "self_attn.k_proj."))
                     else (name, param, start, shape, fn)
                     for name, param, start, shape, fn in per_layer]
    if cfg.qk_norm:
        per_layer += [("self_attn.q_norm.weight", "q_norm", (0,), (D,), same),
                      ("self_attn.k_norm.weight", "k_norm", (0,), (D,), same)]
    if cfg.qk_norm_whole:  # OLMoE: [H*D] and [K*D], laid out as the heads
        per_layer += [("self_attn.q_norm.weight", "q_norm", (0, 0, 0), (K * G * D,),
                       lambda x: x.reshape(K, G, D)),
                      ("self_attn.k_norm.weight", "k_norm", (0, 0), (K * D,),
                       lambda x: x.reshape(K, D))]
    if cfg.sandwich_norms:  # Gemma 3: post_attention_layernorm really follows attention
        per_layer += [("post_attention_layernorm.weight", "post_attn_norm", (0,), (E,), same),
                      ("pre_feedforward_layernorm.weight", "mlp_norm", (0,), (E,), same),
                      ("post_feedforward_layernorm.weight", "post_mlp_norm", (0,), (E,), same)]
    else:  # Llama's post_attention_layernorm is the norm before the MLP
        per_layer.append(("post_attention_layernorm.weight", "mlp_norm", (0,), (E,), same))

    for g, group in enumerate(layer_groups(cfg)):
        mlp = (MOE_LAYOUTS.get(cfg.architecture, _moe_mlp)(cfg, gate_up)
               if group.kind in MOE_KINDS
               else _gated_mlp(MLP_PREFIX.get(cfg.architecture, "mlp."), F, E, gate_up))
        attention = _mla_layer(cfg) if group.kind.startswith("mla") else per_layer
        if group.kind.startswith("gdn"):  # Qwen3-Next's linear attention
            attention = qwen3_next_weights.gdn_layer(cfg)
        elif group.kind.startswith("gated_attn"):
            attention = [t for t in per_layer if t[0] != "self_attn.q_proj.weight"] \
                + qwen3_next_weights.gated_q_proj(cfg)
        for i in range(group.first, group.first + group.count):
            for name, param, start, shape, fn in attention + mlp:
                out.setdefault(f"model.layers.{i}.{name}", []).append(Target(
                    ("layers", g, param), (i - group.first, *start), shape,
                    lambda x, fn=fn: fn(x)[None],
                    jnp.float32 if param in F32_PARAMS and cfg.router_f32 else None))
    return out


def _gated_mlp(prefix: str, F: int, E: int, gate_up: Callable) -> list:
    """A dense gated MLP's three tensors (`prefix`gate_proj/up_proj/down_proj) -> the fused
    gate_up and down weights (of the dense MLP, or of Qwen2-MoE's shared expert)."""
    return [(f"{prefix}gate_proj.weight", "gate_up", (0, 0, 0), (F, E), gate_up),
            (f"{prefix}up_proj.weight", "gate_up", (0, 1, 0), (F, E), gate_up),
            (f"{prefix}down_proj.weight", "down", (0, 0), (E, F), lambda x: x.T)]


def _moe_mlp(cfg: ModelConfig, gate_up: Callable) -> list:
    """A sparse MoE MLP's tensors: the router, every expert's gate/up/down (stacked into the
    experts axis), and Qwen2-MoE's shared expert and its gate. Mixtral names them
    block_sparse_moe.{gate, experts.N.w1 (gate), w3 (up), w2 (down)}."""
    E, X, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    mixtral = cfg.architecture == "MixtralForCausalLM"
    prefix = "block_sparse_moe." if mixtral else "mlp."
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = [(f"{prefix}gate.weight", "router", (0, 0), (X, E), lambda x: x.T)]
    if cfg.router_bias:  # DeepSeek-V3
        out.append((f"{prefix}gate.e_score_correction_bias", "router_bias", (0,), (X,),
                    lambda x: x))
    for j in range(X):
        expert = lambda x: gate_up(x)[None]  # noqa: E731  [F, E] -> [1, E, 1, F]
        out += [(f"{prefix}experts.{j}.{names[0]}.weight", "experts_gate_up", (j, 0, 0, 0),
                 (F, E), expert),
                (f"{prefix}experts.{j}.{names[1]}.weight", "experts_gate_up", (j, 0, 1, 0),
                 (F, E), expert),
                (f"{prefix}experts.{j}.{names[2]}.weight", "experts_down", (j, 0, 0), (E, F),
                 lambda x: x.T[None])]
    if cfg.shared_expert_intermediate_size and not cfg.shared_expert_gated:  # DeepSeek
        out += _gated_mlp("mlp.shared_experts.", cfg.shared_expert_intermediate_size, E, gate_up)
    elif cfg.shared_expert_intermediate_size:
        out += _gated_mlp("mlp.shared_expert.", cfg.shared_expert_intermediate_size, E, gate_up)
        out.append(("mlp.shared_expert_gate.weight", "shared_gate", (0, 0), (1, E),
                    lambda x: x.T))
    return out


def _mla_layer(cfg: ModelConfig) -> list:
    """A DeepSeek layer's attention tensors and norms -> jaxllm/models/mla.py's layouts."""
    E, H, R, Rq, Dr = (cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank,
                       cfg.head_dim)
    Dq, Dkv, Dv = cfg.qk_nope_head_dim + Dr, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    same, t = (lambda x: x), (lambda x: x.T)  # noqa: E731

    def heads_out(n, k):  # [H*n, k] -> [k, H, n]
        return lambda x: x.reshape(H, n, k).transpose(2, 0, 1)

    out = [("input_layernorm.weight", "attn_norm", (0,), (E,), same),
           ("post_attention_layernorm.weight", "mlp_norm", (0,), (E,), same),
           ("self_attn.kv_a_proj_with_mqa.weight", "kv_a", (0, 0), (R + Dr, E), t),
           ("self_attn.kv_a_layernorm.weight", "kv_a_norm", (0,), (R,), same),
           ("self_attn.kv_b_proj.weight", "kv_b", (0, 0, 0), (H * Dkv, R), heads_out(Dkv, R)),
           ("self_attn.o_proj.weight", "o", (0, 0, 0), (E, H * Dv),
            lambda x: x.reshape(E, H, Dv).transpose(1, 2, 0))]
    if Rq:
        out += [("self_attn.q_a_proj.weight", "q_a", (0, 0), (Rq, E), t),
                ("self_attn.q_a_layernorm.weight", "q_a_norm", (0,), (Rq,), same),
                ("self_attn.q_b_proj.weight", "q_b", (0, 0, 0), (H * Dq, Rq), heads_out(Dq, Rq))]
    else:
        out.append(("self_attn.q_proj.weight", "q", (0, 0, 0), (H * Dq, E), heads_out(Dq, E)))
    return out


# Architectures whose checkpoints carry multi-token-prediction layers past the last one.
MTP_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


def _past_last_layer(cfg: ModelConfig, name: str) -> bool:
    """A DeepSeek or GLM-4.5 checkpoint's MTP layers (model.layers.N+, N = num_hidden_layers):
    skipped as transformers skips them (the MTP drafter reads them: loader/mtp_weights.py)."""
    parts = name.split(".")
    return (cfg.architecture in MTP_ARCHITECTURES and len(parts) > 2
            and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= cfg.num_layers)


def _granite_moe_mlp(cfg: ModelConfig, gate_up: Callable) -> list:
    """GraniteMoE stores each layer's experts stacked: block_sparse_moe.input_linear [X, 2F, E]
    (gate rows, then up rows), output_linear [X, E, F], and the router as router.layer."""
    E, X, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    prefix = "block_sparse_moe."
    return [(f"{prefix}router.layer.weight", "router", (0, 0), (X, E), lambda x: x.T),
            (f"{prefix}input_linear.weight", "experts_gate_up", (0, 0, 0, 0), (X, 2 * F, E),
             lambda x: x.reshape(X, 2, F, E).transpose(0, 3, 1, 2)),
            (f"{prefix}output_linear.weight", "experts_down", (0, 0, 0), (X, E, F),
             lambda x: x.transpose(0, 2, 1))]


def _gpt_oss_mlp(cfg: ModelConfig, gate_up: Callable) -> list:
    """GPT-OSS stores each layer's experts stacked: mlp.experts.gate_up_proj [X, E, 2F] with
    gate and up interleaved (even columns gate, odd up), down_proj [X, F, E], and a bias for
    each, the router as mlp.router.{weight, bias}; with them the attention's self_attn.sinks
    [H] (one logit per query head). MXFP4 checkpoints' experts are blocks and scales under
    these names plus _blocks / _scales (jaxllm/loader/mxfp4.py's `kept_targets`)."""
    E, X, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    K, G = cfg.num_kv_heads, cfg.q_per_kv
    same = lambda x: x  # noqa: E731
    return [("self_attn.sinks", "sinks", (0, 0), (K * G,), lambda x: x.reshape(K, G)),
            ("mlp.router.weight", "router", (0, 0), (X, E), lambda x: x.T),
            ("mlp.router.bias", "router_logit_bias", (0,), (X,), same),
            ("mlp.experts.gate_up_proj", "experts_gate_up", (0, 0, 0, 0), (X, E, 2 * F),
             lambda x: x.reshape(X, E, F, 2).transpose(0, 1, 3, 2)),
            ("mlp.experts.gate_up_proj_bias", "experts_gate_up_bias", (0, 0, 0), (X, 2 * F),
             lambda x: x.reshape(X, F, 2).transpose(0, 2, 1)),
            ("mlp.experts.down_proj", "experts_down", (0, 0, 0), (X, F, E), same),
            ("mlp.experts.down_proj_bias", "experts_down_bias", (0, 0), (X, E), same)]



def _llama4_moe_mlp(cfg: ModelConfig, gate_up: Callable) -> list:
    """Llama 4's feed_forward: router [X, E], the experts stacked as [in, out] matrices
    (experts.gate_up_proj [X, E, 2F]: gate columns, then up; experts.down_proj [X, F, E]) and
    the shared expert's three projections."""
    E, X, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    p = "feed_forward."
    return [(f"{p}router.weight", "router", (0, 0), (X, E), lambda x: x.T),
            (f"{p}experts.gate_up_proj", "experts_gate_up", (0, 0, 0, 0), (X, E, 2 * F),
             lambda x: x.reshape(X, E, 2, F)),
            (f"{p}experts.down_proj", "experts_down", (0, 0, 0), (X, F, E), lambda x: x),
            *_gated_mlp(f"{p}shared_expert.", cfg.shared_expert_intermediate_size, E, gate_up)]


def _qwen3_vl_moe_mlp(cfg: ModelConfig, gate_up: Callable) -> list:
    """Qwen3-VL-MoE's sparse MLP: the router mlp.gate [X, E] and the experts stacked, as
    published [in, out] (experts.gate_up_proj [X, E, 2F]: gate columns, then up;
    experts.down_proj [X, F, E]) or as transformers 5 saves them, [out, in] ([X, 2F, E],
    [X, E, F]); where both readings fit the shape, the [out, in] one, as transformers'
    loader (its Transpose with check_dims) decides."""
    E, X, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size

    def stacked(name, out_in, in_out, split):
        def to_block(x):
            if x.shape == out_in:
                x = x.transpose(0, 2, 1)
            elif x.shape != in_out:
                raise CheckpointError(f"{name}: shape {list(x.shape)}, expected {list(in_out)} "
                                      f"or {list(out_in)}")
            return x.reshape(X, E, 2, F) if split else x
        return to_block

    p = "mlp."
    return [(f"{p}gate.weight", "router", (0, 0), (X, E), lambda x: x.T),
            (f"{p}experts.gate_up_proj", "experts_gate_up", (0, 0, 0, 0), None,
             stacked("experts.gate_up_proj", (X, 2 * F, E), (X, E, 2 * F), True)),
            (f"{p}experts.down_proj", "experts_down", (0, 0, 0), None,
             stacked("experts.down_proj", (X, E, F), (X, F, E), False))]


# Architectures whose MoE tensors are not named and shaped as Mixtral's or Qwen's.
MOE_LAYOUTS = {"Qwen3VLMoeForConditionalGeneration": _qwen3_vl_moe_mlp,
               "GraniteMoeForCausalLM": _granite_moe_mlp, "GptOssForCausalLM": _gpt_oss_mlp,
               "Llama4ForCausalLM": _llama4_moe_mlp,
               "Llama4ForConditionalGeneration": _llama4_moe_mlp}
# Architectures whose dense MLP is not under `mlp.`.
MLP_PREFIX = {"Llama4ForCausalLM": "feed_forward.",
              "Llama4ForConditionalGeneration": "feed_forward."}


def _phi3_fused(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Phi-3's fused tensors: qkv_proj rows are q, k, v; gate_up_proj rows are gate, up."""
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    F = cfg.intermediate_size
    return {"self_attn.qkv_proj.weight": [("self_attn.q_proj.weight", qd),
                                          ("self_attn.k_proj.weight", kd),
                                          ("self_attn.v_proj.weight", kd)],
            "mlp.gate_up_proj.weight": [("mlp.gate_proj.weight", F), ("mlp.up_proj.weight", F)]}


# Architectures whose checkpoints fuse projections the model's targets name one by one.
FUSED_LAYOUTS = {"Phi3ForCausalLM": _phi3_fused}


def _fused(targets: dict, cfg: ModelConfig, layout: Callable) -> dict[str, list[Target]]:
    """`targets` with each layer's parts replaced by the fused tensor, each part's targets
    reading its rows."""
    out = dict(targets)
    for i in range(cfg.num_layers):
        for fused, parts in layout(cfg).items():
            row, new = 0, []
            for part, rows in parts:
                for t in out.pop(f"model.layers.{i}.{part}"):
                    new.append(Target(t.param, t.start, None,
                                      lambda x, t=t, a=row, b=row + rows: t.to_block(x[a:b]),
                                      t.dtype))
                row += rows
            new[0] = Target(new[0].param, new[0].start, (row, cfg.hidden_size),
                            new[0].to_block, new[0].dtype)
            out[f"model.layers.{i}.{fused}"] = new
    return out


def _vision_targets(cfg: ModelConfig) -> dict[str, list[Target]]:
    """The vision tower's tensors (jaxllm/models/qwen2_5_vl.py, gemma3_vision.py): stacked
    blocks by layer. A target's rank, or its start offsets in a fused parameter."""
    out = {}
    table = (gemma3_vision.vision_targets if isinstance(cfg.vision, Gemma3VisionSpec)
             else qwen3_vl.vision_targets if isinstance(cfg.vision, Qwen3VLVisionSpec)
             else vision_targets)(cfg.vision)
    for name, (param, layer, fn, rank) in table.items():
        start = (0,) * rank if isinstance(rank, int) else tuple(rank)
        at, f = (start, fn) if layer is None else ((layer,) + start, lambda x, fn=fn: fn(x)[None])
        out[name] = [Target(("vision", param), at, None, f)]
    return out


def _renamed(tensors: Iterable, origin: Callable, rename: Callable) -> tuple[Iterable, Callable]:
    """The tensors under their text-model names (the skipped ones dropped), and `origin`
    answering for the new names with the checkpoint's files."""
    back: dict[str, str] = {}

    def gen():
        for name, array in tensors:
            new = rename(name)
            if new is not None:
                back[new] = name
                yield new, array

    return gen(), lambda name: origin(back.get(name, name))


def param_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """The state with each parameter replaced by its NamedSharding (from its logical axes)."""
    return jax.tree.map(
        lambda v: v.replace(named_sharding(mesh, v.get_metadata()["out_sharding"], v.shape)),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _write(buf: jax.Array, block: jax.Array, start: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(buf, block, tuple(start))


def load_weights(model: Decoder, tensors: Iterable[tuple[str, np.ndarray]], mesh: Mesh, *,
                 where: Union[str, Callable[[str], str]], progress: bool = False,
                 targets: Optional[dict[str, list[Target]]] = None) -> nnx.State:
    """The state of an abstract `Decoder` filled from (HF name, array) pairs.

    where: the checkpoint file (or name -> file) for error messages. A tied model may omit
    lm_head.weight; a tensor the model does not use is an error, unless in IGNORED_SUFFIXES.
    targets: where each tensor goes (default hf_targets; the MTP drafter gives its own).
    """
    cfg = model.cfg
    origin = (lambda name: where) if isinstance(where, str) else where
    if cfg.architecture in TEXT_NAMES:  # a multimodal checkpoint loaded for text only
        tensors, origin = _renamed(tensors, origin, TEXT_NAMES[cfg.architecture])
    if cfg.mxfp4_experts and cfg.quant is None:  # GPT-OSS's experts, dequantized as they arrive
        tensors = dequantized_experts(tensors, origin, CheckpointError, np.dtype(cfg.jnp_dtype))
    targets = hf_targets(cfg) if targets is None else targets
    state = nnx.state(model)
    shardings = param_shardings(state, mesh)
    state = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), state),
                    out_shardings=shardings)()
    params = dict(nnx.to_flat_state(state))
    for path, var in params.items():  # KV scales the checkpoint does not give stay 1.0
        if path[-1] == "kv_scales":
            var.set_value(jnp.ones_like(var.get_value()))
    writers = {path: jax.jit(_write, donate_argnums=0, out_shardings=sh.get_value())
               for path, sh in nnx.to_flat_state(shardings)}

    dtype, seen = cfg.jnp_dtype, set()
    total = sum(not is_kv_scale(n) for n in targets)  # (KV scales: optional, not counted)
    for name, array in tqdm(tensors, total=total, desc="Loading weights", unit="tensor",
                            disable=None if progress else True, leave=False):
        ts = targets.get(name)
        if ts is None:
            if name.endswith(IGNORED_SUFFIXES) or name.startswith(HEAD_PREFIXES) \
                    or (name == "lm_head.weight" and cfg.tie_word_embeddings) \
                    or _past_last_layer(cfg, name) or is_kv_scale(name):  # unused KV scales
                continue
            raise CheckpointError(f"{origin(name)}: unexpected tensor {name!r} (shape "
                                  f"{tuple(array.shape)}) for {cfg.architecture}")
        shape = ts[0].shape
        if shape is not None and tuple(array.shape) != shape:
            raise CheckpointError(f"{origin(name)}: tensor {name!r} has shape "
                                  f"{tuple(array.shape)}, expected {shape}")
        if name in seen:
            raise CheckpointError(f"{origin(name)}: tensor {name!r} appears twice")
        seen.add(name)
        for t in ts:
            try:
                block = storage_cast(t.to_block(np.asarray(array)),
                                     dtype if t.dtype is None else t.dtype)
            except ValueError as e:  # a quantized tensor that does not fit its projection
                raise CheckpointError(f"{origin(name)}: tensor {name!r}: {e}") from e
            if t.param is None:
                continue
            var = params[t.param]
            var.set_value(writers[t.param](var.get_value(), block,
                                           np.asarray(t.start, np.int32)))

    if cfg.kv_scales == FROM_CHECKPOINT:
        warn_missing(missing_layers(cfg.num_layers, seen), cfg.num_layers)
    missing = [n for n in targets if n not in seen and not is_kv_scale(n)]
    if missing:
        raise CheckpointError(f"{origin(missing[0])}: {len(missing)} tensor(s) missing for "
                              f"{cfg.architecture}, e.g. {', '.join(missing[:4])}")
    return state
