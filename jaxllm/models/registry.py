"""Which Hugging Face architectures run, and what each changes in the one generic decoder.

An adapter reads a transformers config and returns only the fields of `ModelConfig` that differ
from the Llama defaults; the decoder itself has no per-architecture code.
"""

from __future__ import annotations

import copy

from typing import Callable

from jaxllm.config import ConfigError
from jaxllm.models.bert_spec import ENCODER_ARCHITECTURES, encoder_features
from jaxllm.models.gemma4_spec import Gemma4Spec
from jaxllm.models.qwen3_vl_spec import Qwen3VLVisionSpec, text_features as _qwen3_vl_text
from jaxllm.models.vision_spec import Gemma3VisionSpec, VisionSpec, mrope_section


def _llama(c) -> dict:  # also Mistral: bias flags and sliding window come from the config
    return {}


def _qwen2(c) -> dict:
    return dict(qkv_bias=True, o_bias=False)  # Qwen2 hard-codes q/k/v biases


def _qwen3(c) -> dict:
    return dict(qk_norm=True)


def _gemma2(c) -> dict:
    return dict(norm_offset=1.0, embed_scale=c.hidden_size ** 0.5, sandwich_norms=True,
                query_pre_attn_scalar=float(c.query_pre_attn_scalar),
                final_logit_softcap=c.final_logit_softcapping,
                attn_logit_softcap=c.attn_logit_softcapping)


def _gemma3(c) -> dict:
    if getattr(c, "use_bidirectional_attention", False):
        raise ConfigError("Gemma 3 with use_bidirectional_attention (an embedding model) is not "
                          "supported")
    # Gemma 3 replaced attention soft-capping by q/k norms: transformers and vLLM ignore
    # attn_logit_softcapping even when the config sets it.
    return dict(_gemma2(c), qk_norm=True, attn_logit_softcap=None)


def _sparse_layers(c) -> tuple[bool, ...]:
    """Which layers have the sparse MoE MLP, as transformers' Qwen MoE decoder layers decide."""
    only_dense = set(getattr(c, "mlp_only_layers", None) or ())
    step = getattr(c, "decoder_sparse_step", 1) or 1
    return tuple(i not in only_dense and c.num_experts > 0 and (i + 1) % step == 0
                 for i in range(c.num_hidden_layers))


def _mixtral(c) -> dict:  # softmax over all experts, top-k, renormalized; every layer sparse
    return dict(moe_layers=(True,) * c.num_hidden_layers, num_experts=c.num_local_experts,
                num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.intermediate_size, norm_topk_prob=True)


def _qwen_moe(c) -> dict:
    return dict(moe_layers=_sparse_layers(c), num_experts=c.num_experts,
                num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size,
                norm_topk_prob=bool(c.norm_topk_prob))


def _qwen2_moe(c) -> dict:  # q/k/v biases from `qkv_bias`, a shared expert with a sigmoid gate
    return dict(_qwen_moe(c), qkv_bias=bool(getattr(c, "qkv_bias", True)), o_bias=False,
                shared_expert_intermediate_size=c.shared_expert_intermediate_size)


def _qwen3_moe(c) -> dict:
    return dict(_qwen_moe(c), qk_norm=True)


def _deepseek(c, v3: bool) -> dict:
    """DeepSeek-V2/V3 (and Kimi-K2, a V3): multi-head latent attention, the first
    `first_k_dense_replace` layers dense, the others routed experts plus ungated shared
    experts; routing as transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter."""
    name = "DeepSeek-V3" if v3 else "DeepSeek-V2"
    if getattr(c, "attention_bias", False):
        raise ConfigError(f"{name} with attention_bias=True is not supported")
    if (getattr(c, "moe_layer_freq", 1) or 1) != 1:
        raise ConfigError(f"{name} moe_layer_freq={c.moe_layer_freq} is not supported "
                          "(transformers ignores it; only 1 is)")
    method = "noaux_tc" if v3 else (c.topk_method or "greedy")
    for key, want in (("topk_method", method), ("scoring_func", "sigmoid" if v3 else "softmax")):
        have = getattr(c, key, None)
        if have is not None and have != want:
            raise ConfigError(f"{name} {key}={have!r} is not supported ({want!r} only)")
    if not v3 and c.norm_topk_prob:
        raise ConfigError("DeepSeek-V2 norm_topk_prob=True is refused: transformers' "
                          "DeepseekV2 router ignores it, DeepSeek's own code applies it")
    X, k = c.n_routed_experts, c.num_experts_per_tok
    n_group = (c.n_group or 1) if method != "greedy" else 1
    topk_group = (c.topk_group or n_group) if method != "greedy" else 1
    if X % n_group or not 1 <= topk_group <= n_group or k > topk_group * (X // n_group) \
            or (method == "noaux_tc" and X // n_group < 2):
        raise ConfigError(f"{name}: {X} experts in n_group={n_group} groups, topk_group="
                          f"{topk_group}, num_experts_per_tok={k} do not fit")
    dense = c.first_k_dense_replace or 0
    return dict(
        num_kv_heads=c.num_attention_heads, head_dim=c.qk_rope_head_dim, qkv_bias=False,
        o_bias=False, moe_layers=tuple(i >= dense for i in range(c.num_hidden_layers)),
        num_experts=X, num_experts_per_tok=k, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
        shared_expert_gated=False, norm_topk_prob=bool(v3 and c.norm_topk_prob),
        scoring_func="sigmoid" if v3 else "softmax", topk_method=method, n_group=n_group,
        topk_group=topk_group, router_bias=v3, router_f32=True,
        routed_scaling_factor=float(c.routed_scaling_factor),
        kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank or 0,
        qk_nope_head_dim=c.qk_nope_head_dim, v_head_dim=c.v_head_dim,
        rope_interleave=bool(getattr(c, "rope_interleave", True)) if v3 else True)


def _glm4_moe(c) -> dict:
    """GLM-4.5 (Glm4MoeForCausalLM): grouped-query attention with q/k/v biases, optional q/k
    norms and partial rotary embeddings (RopeSpec reads partial_rotary_factor); DeepSeek-V3's
    routing (sigmoid, correction bias, groups) with ungated shared experts after
    `first_k_dense_replace` dense layers."""
    X, k = c.n_routed_experts, c.num_experts_per_tok
    n_group, topk_group = c.n_group or 1, c.topk_group or 1
    if X % n_group or not 1 <= topk_group <= n_group or k > topk_group * (X // n_group) \
            or X // n_group < 2:
        raise ConfigError(f"GLM-4.5: {X} experts in n_group={n_group} groups, topk_group="
                          f"{topk_group}, num_experts_per_tok={k} do not fit")
    dense = c.first_k_dense_replace or 0
    return dict(
        qkv_bias=bool(c.attention_bias), o_bias=False, qk_norm=bool(c.use_qk_norm),
        moe_layers=tuple(i >= dense for i in range(c.num_hidden_layers)),
        num_experts=X, num_experts_per_tok=k, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
        shared_expert_gated=False, norm_topk_prob=bool(c.norm_topk_prob),
        scoring_func="sigmoid", topk_method="noaux_tc", n_group=n_group, topk_group=topk_group,
        router_bias=True, router_f32=True, routed_scaling_factor=float(c.routed_scaling_factor))

def _granite(c) -> dict:
    if not c.logits_scaling > 0:  # a non-positive divisor would flip or break the argmax
        raise ConfigError(f"Granite logits_scaling={c.logits_scaling} must be positive")
    return dict(embed_scale=float(c.embedding_multiplier),
                residual_multiplier=float(c.residual_multiplier),
                attention_multiplier=float(c.attention_multiplier),
                logits_scaling=float(c.logits_scaling))


def _granite_moe(c) -> dict:  # softmax over the top-k logits = renormalized top-k
    return dict(_granite(c), moe_layers=(True,) * c.num_hidden_layers,
                num_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.intermediate_size, norm_topk_prob=True)


def _olmoe(c) -> dict:  # softmax over all experts, top-k, renormalized if norm_topk_prob
    if getattr(c, "clip_qkv", None) is not None:
        raise ConfigError(f"OLMoE with clip_qkv={c.clip_qkv} is not supported")
    return dict(qk_norm_whole=True, moe_layers=(True,) * c.num_hidden_layers,
                num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.intermediate_size,
                norm_topk_prob=bool(c.norm_topk_prob))


def _phi3(c) -> dict:  # Llama's math; fused checkpoint tensors and LongRoPE live elsewhere
    return {}


def _gpt_oss(c) -> dict:
    """GPT-OSS: attention with biases (`attention_bias`) and sinks over alternating sliding and
    full layers (`layer_types`), every layer's MLP a top-k router (softmax over the chosen
    logits) with biased experts and a clamped SwiGLU; MXFP4 expert weights are kept 4-bit (the
    checkpoint's quantization_config: the `mxfp4` QuantSpec)."""
    qc = getattr(c, "quantization_config", None)
    qc = qc if qc is None or isinstance(qc, dict) else qc.to_dict()
    method = (qc or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise ConfigError(f"GPT-OSS quantization method {method!r} is not supported (float or "
                          "'mxfp4' checkpoints only)")
    return dict(attention_sinks=True, expert_bias=True,
                moe_layers=(True,) * c.num_hidden_layers, num_experts=c.num_local_experts,
                num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.intermediate_size, scoring_func="topk_softmax",
                swiglu_clamp=(float(c.swiglu_alpha), float(c.swiglu_limit)),
                mxfp4_experts=method == "mxfp4", norm_scale_f32=True)


def _llama4(c) -> dict:
    """Llama 4 text (jaxllm/models/llama4.py): NoPE layers with temperature tuning, chunked
    local attention on the RoPE layers, the RoPE layers' q/k L2 norm; MoE layers (`moe_layers`,
    which transformers derives from interleave_moe_layer_step) of top-1 sigmoid routing that
    scales the expert's input, plus an ungated shared expert; dense layers of
    intermediate_size_mlp."""
    n = c.num_hidden_layers
    if c.num_experts_per_tok != 1:  # the weight scales each expert's input: one per token
        raise ConfigError(f"Llama 4 num_experts_per_tok={c.num_experts_per_tok} is not "
                          "supported (1 only)")
    if len(c.no_rope_layers) < n:
        raise ConfigError(f"Llama 4 no_rope_layers has {len(c.no_rope_layers)} entries for "
                          f"{n} layers")
    kinds = set(c.layer_types) - {"full_attention", "chunked_attention"}
    if kinds:
        raise ConfigError(f"Llama 4 layer_types {sorted(kinds)} are not supported")
    chunk = c.attention_chunk_size or 0
    moe = set(c.moe_layers)
    return dict(
        intermediate_size=c.intermediate_size_mlp,
        nope_layers=tuple(not c.no_rope_layers[i] for i in range(n)),
        attention_chunk=tuple(chunk if t == "chunked_attention" else 0 for t in c.layer_types),
        attn_temperature=((float(c.floor_scale), float(c.attn_scale))
                          if c.attn_temperature_tuning else None),
        qk_l2_norm=bool(c.use_qk_norm), router_scales_input=True,
        moe_layers=tuple(i in moe for i in range(n)), num_experts=c.num_local_experts,
        num_experts_per_tok=1, moe_intermediate_size=c.intermediate_size,
        shared_expert_intermediate_size=c.intermediate_size, shared_expert_gated=False,
        scoring_func="sigmoid")


def _qwen3_next(c) -> dict:
    """Qwen3-Next: gated DeltaNet layers where layer_types says linear_attention, gated full
    attention (q/k norms, partial rotary) in the others; zero-centred norms; the Qwen MoE MLP
    with a gated shared expert where `_sparse_layers` says (else the dense one)."""
    types = list(c.layer_types)
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"{c.architectures[0]}: layer_types {unknown} are not supported")
    if "full_attention" not in types:
        raise ConfigError(f"{c.architectures[0]}: layer_types without a full_attention layer "
                          "are not supported (the KV cache is sized over full-attention "
                          "layers)")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ConfigError(f"{c.architectures[0]}: hidden_act={c.hidden_act!r} is not "
                          "supported (the DeltaNet's convolution and gate are SiLU)")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise ConfigError(f"linear_num_value_heads={c.linear_num_value_heads} is not a "
                          f"multiple of linear_num_key_heads={c.linear_num_key_heads}")
    out = dict(qk_norm=True, norm_offset=1.0, qkv_bias=False, o_bias=False,
               linear_layers=tuple(t == "linear_attention" for t in types),
               linear_num_k_heads=c.linear_num_key_heads,
               linear_num_v_heads=c.linear_num_value_heads,
               linear_k_dim=c.linear_key_head_dim, linear_v_dim=c.linear_value_head_dim,
               linear_conv_kernel=c.linear_conv_kernel_dim)
    if getattr(c, "num_experts", 0):
        out.update(_qwen_moe(c),
                   shared_expert_intermediate_size=c.shared_expert_intermediate_size)
    return out


def _qwen3_5_moe(c) -> dict:
    """Qwen3.5-MoE: Qwen3-Next's layers, every MLP the sparse one (routed experts, softmax
    top-k always renormalized: its config has no norm_topk_prob, gated shared expert)."""
    if not getattr(c, "num_experts", 0):
        raise ConfigError(f"{c.architectures[0]}: num_experts must be positive")
    c = copy.copy(c)
    c.norm_topk_prob = True
    return _qwen3_next(c)


def _qwen3_vl_moe(c) -> dict:
    """Qwen3-VL-MoE's text model: Qwen3-MoE's layers, the top-k always renormalized (its
    config has no norm_topk_prob; transformers' router always divides by the sum)."""
    c = copy.copy(c)
    c.norm_topk_prob = True
    return _qwen3_moe(c)


def _gemma4(c) -> dict:
    """Gemma 4 text (jaxllm/models/gemma4.py): Gemma's sandwich norms (scaling by w, not
    1 + w), q/k norms and a weightless v norm, attention scale 1, per-layer-type head dims and
    KV heads, per-layer inputs, KV sharing; its Gemma4Spec carries what only it has."""
    if getattr(c, "use_bidirectional_attention", None) == "all":
        raise ConfigError("Gemma 4 with use_bidirectional_attention='all' (an embedding model) "
                          "is not supported")
    if getattr(c, "attention_bias", False):
        raise ConfigError("Gemma 4 with attention_bias=True is not supported")
    moe = {}
    if getattr(c, "enable_moe_block", False):  # experts beside every layer's dense MLP
        moe = dict(num_experts=c.num_experts, num_experts_per_tok=c.top_k_experts,
                   moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=True)
    spec = Gemma4Spec.from_hf(c)
    # The config's head_dim and KV heads vary per layer (transformers refuses to read them
    # globally); the model-wide values are the sliding layers', Gemma4Spec has the full ones'.
    # (c is from_hf's own copy of the config.)
    sliding = c.layer_types.index("sliding_attention") if "sliding_attention" in c.layer_types \
        else 0
    geometry = c.per_layer_config[sliding]
    c.allow_global_per_layer_attribute_access = True
    return dict(head_dim=geometry.head_dim, num_kv_heads=geometry.num_key_value_heads,
                embed_scale=c.hidden_size ** 0.5, sandwich_norms=True, qk_norm=True,
                attention_multiplier=1.0, norm_scale_f32=True,
                final_logit_softcap=c.final_logit_softcapping, qkv_bias=False, o_bias=False,
                gemma4=spec, **moe)


ARCHITECTURES: dict[str, Callable[[object], dict]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "DeepseekV2ForCausalLM": lambda c: _deepseek(c, v3=False),
    "DeepseekV3ForCausalLM": lambda c: _deepseek(c, v3=True),
    "Glm4MoeForCausalLM": _glm4_moe,
    "GraniteForCausalLM": _granite,
    "GraniteMoeForCausalLM": _granite_moe,
    "OlmoeForCausalLM": _olmoe,
    "Phi3ForCausalLM": _phi3,
    "Gemma3ForConditionalGeneration": _gemma3,  # SigLIP tower: jaxllm/models/gemma3_vision.py
    "GptOssForCausalLM": _gpt_oss,
    "Llama4ForCausalLM": _llama4,
    "Llama4ForConditionalGeneration": _llama4,  # its language model only (loader/weights.py)
    "Qwen2_5_VLForConditionalGeneration": lambda c: dict(_qwen2(c), mrope_section=mrope_section(c)),
    "Qwen3NextForCausalLM": _qwen3_next,
    "Qwen3_5ForCausalLM": _qwen3_next,  # the same layers; its checkpoint splits in_proj
    "Qwen3_5MoeForCausalLM": _qwen3_5_moe,
    # their language models only (loader/weights.py); images refused (a text-only model)
    "Qwen3_5ForConditionalGeneration": _qwen3_next,
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5_moe,
    "Gemma4ForCausalLM": _gemma4,
    "Gemma4ForConditionalGeneration": _gemma4,  # its text model only (loader/gemma4_weights.py)
    # Qwen3 with interleaved M-RoPE and deepstack (jaxllm/models/qwen3_vl.py)
    "Qwen3VLForConditionalGeneration": lambda c: dict(_qwen3(c), **_qwen3_vl_text(c)),
    "Qwen3VLMoeForConditionalGeneration": lambda c: dict(_qwen3_vl_moe(c), **_qwen3_vl_text(c)),
}

# Architectures with a vision tower: top-level config -> ModelConfig.vision.
VISION_TOWERS: dict[str, Callable[[object], object]] = {
    "Qwen2_5_VLForConditionalGeneration": VisionSpec.from_hf,
    "Gemma3ForConditionalGeneration": Gemma3VisionSpec.from_hf,
    "Qwen3VLForConditionalGeneration": Qwen3VLVisionSpec.from_hf,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLVisionSpec.from_hf,
}
# Multimodal architectures whose LM head ties to the embeddings as the top-level config says
# (transformers reads `tie_word_embeddings` there; their text config may not carry it).
TOP_LEVEL_TIE = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                 "Qwen3VLMoeForConditionalGeneration")


def _classifier(adapter: Callable[[object], dict]) -> Callable[[object], dict]:
    """A `*ForSequenceClassification` checkpoint: the same decoder with a `score` head instead
    of an LM head. The pooling runner reads the head itself (jaxllm/loader/classifier_head.py)
    and never the decoder's logits, so the decoder is built tied: no lm_head to load."""
    return lambda c: dict(adapter(c), tie_word_embeddings=True)


SEQUENCE_CLASSIFIERS = {"LlamaForSequenceClassification": _llama,
                        "MistralForSequenceClassification": _llama,
                        "Qwen2ForSequenceClassification": _qwen2,
                        "Qwen3ForSequenceClassification": _qwen3}
ARCHITECTURES.update({name: _classifier(f) for name, f in SEQUENCE_CLASSIFIERS.items()})
# Encoder-only models (jaxllm/models/bert.py): the pooling runner only, bidirectional, no KV
# cache; their classifiers' heads are read by jaxllm/loader/classifier_head.py.
ARCHITECTURES.update({name: (lambda c, name=name: encoder_features(c, name))
                      for name in ENCODER_ARCHITECTURES})
ENCODER_CLASSIFIERS = tuple(name for name, (_, head) in ENCODER_ARCHITECTURES.items() if head)


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise ConfigError(f"model architecture {archs or '(none in config.json)'} is not supported; "
                     f"supported: {', '.join(ARCHITECTURES)}")


def arch_features(hf_config) -> tuple[str, dict]:
    """(architecture name, the ModelConfig fields this architecture sets)."""
    arch = architecture_of(hf_config)
    return arch, ARCHITECTURES[arch](hf_config)
