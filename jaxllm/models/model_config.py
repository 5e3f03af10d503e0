"""`ModelConfig`: everything the decoder needs, normalized from a transformers config.

One place reads the many spellings of Hugging Face configs (transformers 5 `rope_parameters`
vs. legacy `rope_theta`/`rope_scaling`, `hidden_act` vs. `hidden_activation`; a config.json's
`torch_dtype` arrives as `dtype`) and applies the engine's overrides and vLLM's rules for
`--dtype auto` and `--max-model-len`. The result is frozen and hashable, so it can sit in a
jitted module.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Optional

import jax
import jax.numpy as jnp

from jaxllm.config import ConfigError
from jaxllm.engine_config import LoRAConfig, ModelOptions
from jaxllm.layers.quantization import QuantSpec
from jaxllm.models.bert_spec import EncoderSpec
from jaxllm.models.gemma4_spec import Gemma4Spec
from jaxllm.models.kv_scales import kv_scales_wanted
from jaxllm.models.quant_config import quant_spec
from jaxllm.models.registry import TOP_LEVEL_TIE, VISION_TOWERS, arch_features
from jaxllm.models.rope import RopeSpec
from jaxllm.models.vision_spec import VisionSpec

# vLLM's keys for the model's context length; the smallest present wins.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_sequence_length", "max_seq_length", "seq_len")
_NO_FLOAT16 = ("gemma2", "gemma3", "gemma3_text")  # activations overflow float16 (as vLLM)
_DTYPE_NAMES = {"half": "float16", "float": "float32"}
ALLOW_LONG_ENV = "JAXLLM_ALLOW_LONG_MAX_MODEL_LEN"


logger = logging.getLogger("jaxllm")


def _on_cpu() -> bool:
    """The devices this process runs on are CPUs (where start-up picks the native kernels)."""
    return jax.default_backend() == "cpu"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: tuple[RopeSpec, ...]         # one per layer
    sliding_window: tuple[int, ...]    # one per layer; 0 = full attention
    max_model_len: int
    dtype: str                         # 'bfloat16' | 'float16' | 'float32'
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    activation: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False               # Qwen3, Gemma 3: RMSNorm over head_dim on q and k
    norm_offset: float = 0.0            # Gemma: norms scale by (1 + w)
    embed_scale: Optional[float] = None  # Gemma: embeddings times sqrt(hidden)
    sandwich_norms: bool = False        # Gemma 2/3: extra norms after attention and the MLP
    query_pre_attn_scalar: Optional[float] = None  # Gemma: softmax scale is its -1/2 power
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE); num_experts 0 = a dense model.
    moe_layers: tuple[bool, ...] = ()   # one per layer: a sparse MoE MLP (else the dense one)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0      # each routed expert's FFN width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert (0 = none)
    norm_topk_prob: bool = False        # renormalize the top-k routing weights to sum to one
    expert_parallel: bool = False       # --enable-expert-parallel: experts sharded, not FFNs
    count_expert_load: bool = False     # --enable-expert-load-metrics: the step counts routes
    quant: Optional[QuantSpec] = None   # quantized layer projections (None: float weights)
    lora: Optional[LoRAConfig] = None   # --enable-lora: adapter slots beside the projections
    prompt_embeds: bool = False         # --enable-prompt-embeds: steps take given embeddings
    # DeepSeek-V2/V3 routing (jaxllm/models/moe.py's `route`): the score function over the
    # router logits ('softmax' | 'sigmoid'), the top-k selection ('greedy',
    # 'group_limited_greedy': V2's groups by their best expert, 'noaux_tc': V3's groups by the
    # sum of their best two biased scores), n_group expert groups of which topk_group are kept,
    # a bias (e_score_correction_bias) added to the scores for selection only, and the weights'
    # final scale. Router weights and input in float32 (`router_f32`, as transformers keeps
    # DeepSeek's gate in float32); the shared experts without a gate (`shared_expert_gated`).
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False
    routed_scaling_factor: float = 1.0
    router_f32: bool = False
    shared_expert_gated: bool = True
    # Multi-head latent attention (DeepSeek-V2/V3; jaxllm/models/mla.py); kv_lora_rank 0 = none.
    # head_dim is then qk_rope_head_dim (the RoPE tables' width), q_lora_rank 0 = a plain q_proj.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False       # the rotary dims come in (even, odd) pairs

    residual_multiplier: float = 1.0    # Granite: each block's output scaled before the residual
    attention_multiplier: Optional[float] = None  # Granite: the softmax scale itself
    logits_scaling: float = 1.0         # Granite: logits divided by it
    qk_norm_whole: bool = False         # OLMoE: q/k RMSNorm over all heads' width at once
    # GPT-OSS: a learned logit per head in each softmax's denominator; biases on the router
    # and on every expert's gate/up and down projections; the experts' clamped SwiGLU
    # (swiglu_alpha, swiglu_limit: `jaxllm.layers.experts.ClampedSwiGLU`); expert weights
    # published as MXFP4 blocks and scales, kept 4-bit (`quant`, jaxllm/loader/mxfp4.py).
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_clamp: Optional[tuple[float, float]] = None  # (alpha, limit)
    mxfp4_experts: bool = False
    norm_scale_f32: bool = False        # GPT-OSS: RMSNorm scales in float32, then rounds
    # Llama 4 (jaxllm/models/llama4.py); nope_layers empty = not Llama 4. Per layer: no RoPE
    # (NoPE) and the attention chunk (0 = none); the NoPE layers' temperature tuning
    # (floor_scale, attn_scale); the weightless q/k norm of RoPE layers; the routing weight
    # scaling the expert's input instead of its output (top-1).
    nope_layers: tuple[bool, ...] = ()
    attention_chunk: tuple[int, ...] = ()
    attn_temperature: Optional[tuple[float, float]] = None
    qk_l2_norm: bool = False
    router_scales_input: bool = False
    # Vision-language models (jaxllm/models/qwen2_5_vl.py): M-RoPE's split of the rotary
    # frequencies over (temporal, height, width) positions (() = 1-D positions), and the
    # vision tower (None = text only).
    mrope_section: tuple[int, ...] = ()
    vision: Optional[VisionSpec] = None
    mrope_interleaved: bool = False  # Qwen3-VL: the sections' frequencies take turns
    # Hybrid models (Qwen3-Next; jaxllm/models/qwen3_next.py): which layers are gated DeltaNet
    # linear attention (the others gated full attention), and the DeltaNet's dimensions.
    linear_layers: tuple[bool, ...] = ()
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv_kernel: int = 0
    # Gemma 4 (jaxllm/models/gemma4.py): per-layer-type geometry, per-layer inputs, KV sharing.
    gemma4: Optional[Gemma4Spec] = None
    # fp8 KV cache (--kv-cache-dtype fp8*): the attention layers hold per-layer (k_scale,
    # v_scale), from the checkpoint ('checkpoint') or computed at start-up ('calculate');
    # None: no scales (jaxllm/models/kv_scales.py).
    kv_scales: Optional[str] = None
    # Encoder-only models (BERT, RoBERTa; jaxllm/models/bert.py): bidirectional, no KV cache,
    # the pooling runner only. None for every decoder.
    encoder: Optional[EncoderSpec] = None

    @property
    def kv_values_per_token(self) -> int:
        """Cache values one token holds per layer: K and V of every KV head, or the MLA
        latent (kv_lora_rank + qk_rope_head_dim, one array: it serves as K and V)."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep a paged KV cache (a hybrid model's linear-attention layers keep a
        per-sequence state instead; an encoder-only model keeps none)."""
        if self.encoder is not None:
            return 0
        if self.gemma4 is not None:  # KV-shared layers read another layer's cache
            return sum(p < 0 for p in self.gemma4.kv_producer)
        return self.num_layers - sum(self.linear_layers)

    @property
    def kv_values_all_layers(self) -> int:
        """Cache values one token holds over all layers (Gemma 4's layer types differ in
        head dim and KV heads; its KV-shared layers hold none)."""
        g = self.gemma4
        if g is None:
            return self.num_kv_layers * self.kv_values_per_token
        return sum(2 * (g.global_kv_heads * g.global_head_dim if full
                        else self.num_kv_heads * self.head_dim)
                   for full, p in zip(g.full_layers, g.kv_producer) if p < 0)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @classmethod
    def from_hf(cls, hf_config, options: Optional[ModelOptions] = None) -> "ModelConfig":
        """From a transformers `PretrainedConfig`, with the engine's overrides (`options`;
        none by default) applied."""
        options = ModelOptions() if options is None else options
        c = copy.deepcopy(hf_config)
        overrides = dict(options.hf_overrides or {})
        rope_scaling = options.rope_scaling or overrides.pop("rope_scaling", None)
        rope_theta = options.rope_theta or overrides.pop("rope_theta", None)
        for key, value in overrides.items():
            setattr(c, key, value)
        checkpoint_quant = getattr(c, "quantization_config", None)
        top = c
        if hasattr(c, "get_text_config"):
            top, archs = c, getattr(c, "architectures", None)
            c = c.get_text_config()
            if archs and c is not top:  # a multimodal model's text part: its adapter decides
                c.architectures = archs
        arch, features = arch_features(c)

        n_layers = c.num_hidden_layers
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ConfigError(f"{heads} attention heads do not divide into {kv_heads} KV heads")
        if getattr(c, "mlp_bias", False):
            raise ConfigError("MLP biases (mlp_bias=True) are not supported")
        bias = bool(getattr(c, "attention_bias", False))
        layer_types = getattr(c, "layer_types", None) or [None] * n_layers
        rope = tuple(_layer_rope(c, t, rope_scaling, rope_theta) for t in layer_types)
        window = _windows(c, layer_types)
        max_len = _max_model_len(c, rope, window, options)
        rope = tuple(r.for_max_model_len(max_len) for r in rope)  # LongRoPE's short/long
        if options.disable_sliding_window:
            window = (0,) * n_layers
        eos = getattr(c, "eos_token_id", None)
        fields = dict(
            architecture=arch,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            # absent where every layer is sparse (Qwen3.5-MoE): no dense MLP to size
            intermediate_size=getattr(c, "intermediate_size", 0),
            # (an encoder's LayerNorm eps: its EncoderSpec)
            rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or c.layer_norm_eps),
            rope=rope,
            sliding_window=window,
            max_model_len=max_len,
            dtype=_resolve_dtype(options.dtype, c),
            eos_token_ids=tuple([eos] if isinstance(eos, int) else eos or ()),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            activation=getattr(c, "hidden_activation", None) or c.hidden_act,
            qkv_bias=bias,
            o_bias=bias,
        )
        fields.update(features)
        if arch in VISION_TOWERS:  # images in: the tower's settings from the top config
            fields["vision"] = VISION_TOWERS[arch](top)
        if arch in TOP_LEVEL_TIE:
            fields["tie_word_embeddings"] = bool(getattr(top, "tie_word_embeddings", False))
        if options.enable_expert_parallel and not fields.get("num_experts"):
            raise ConfigError(f"--enable-expert-parallel: {arch} has no mixture-of-experts "
                              "layers to shard")
        fields["expert_parallel"] = bool(options.enable_expert_parallel)
        if options.enable_expert_load_metrics and not fields.get("num_experts"):
            raise ConfigError(f"--enable-expert-load-metrics: {arch} has no mixture-of-experts "
                              "layers to count")
        fields["count_expert_load"] = bool(options.enable_expert_load_metrics)
        if fields.get("mxfp4_experts") and options.quantization is None and _on_cpu():
            # The native CPU grouped matmul takes float experts (several times faster than
            # decoding MXFP4 in XLA's dots, and batch-invariant): dequantized at load there;
            # --quantization mxfp4 keeps them 4-bit (a quarter of the memory).
            logger.info("GPT-OSS's MXFP4 experts are dequantized at load on CPU "
                        "(--quantization mxfp4 keeps them 4-bit)")
            checkpoint_quant = None
        fields["quant"] = quant_spec(checkpoint_quant, options.quantization)
        if fields["quant"] is not None and fields["quant"].method == "mxfp4" \
                and not fields.get("mxfp4_experts"):  # kept 4-bit: GPT-OSS's experts only
            raise ConfigError(f"mxfp4 quantization of {arch} is not supported (GPT-OSS's "
                              "experts only)")
        fields["lora"] = options.lora
        fields["prompt_embeds"] = bool(options.enable_prompt_embeds)
        gemma4_inputs = getattr(fields.get("gemma4"), "per_layer_size", 0)
        if options.enable_prompt_embeds and (fields.get("vision") or gemma4_inputs):
            raise ConfigError(f"--enable-prompt-embeds: not supported for {arch} (its "
                              + ("images take the embedding rows" if fields.get("vision") else
                                 "per-layer inputs are made from the token ids") + ")")
        fields["kv_scales"] = kv_scales_wanted(fields, options)
        if options.lora is not None and fields.get("nope_layers"):
            raise ConfigError("--enable-lora: Llama 4 adapters are not supported (the loader "
                              "reorders q_proj/k_proj rows for RoPE, adapters are not)")
        return cls(**fields)


def _layer_rope(c, layer_type, rope_scaling, rope_theta) -> RopeSpec:
    """One layer's RoPE from either spelling. Gemma 3's sliding layers have their own (local)
    RoPE; the engine's overrides apply to the other, global, layers."""
    params = getattr(c, "rope_parameters", None) or {}
    nested = layer_type in params
    local = layer_type == "sliding_attention" and (nested or hasattr(c, "rope_local_base_freq"))
    params = dict(params[layer_type] if nested else params)
    if not params and not local:  # legacy spelling
        params = dict(getattr(c, "rope_scaling", None) or {})
    params.setdefault("rope_theta", (getattr(c, "rope_local_base_freq", None) if local else None)
                      or getattr(c, "rope_theta", None) or 10000.0)
    if not local and rope_scaling:
        params = {"rope_theta": params["rope_theta"], **rope_scaling}
    if not local and rope_theta:
        params["rope_theta"] = rope_theta
    return RopeSpec.from_hf(params, c.max_position_embeddings)


def _windows(c, layer_types) -> tuple[int, ...]:
    """Per-layer sliding window (0 = full): `layer_types` when given, else the whole model."""
    w = getattr(c, "sliding_window", None) or 0
    if any(t is not None for t in layer_types):
        return tuple(w if t == "sliding_attention" else 0 for t in layer_types)
    return (w,) * len(layer_types)


def _max_model_len(c, rope, window, options: ModelOptions) -> int:
    """vLLM's rule: the config's context length, stretched by RoPE scaling, capped by the
    smallest sliding window when that is disabled; a larger --max-model-len is an error."""
    lens = [(getattr(c, k), k) for k in _MAX_LEN_KEYS if isinstance(getattr(c, k, None), int)]
    derived, key = min(lens) if lens else (2048, "default")
    spec = rope[window.index(0)] if 0 in window else rope[0]  # a global layer's RoPE
    if spec.rope_type == "yarn":
        derived, key = spec.original_max_position_embeddings * spec.factor, "yarn rope_scaling"
    elif spec.rope_type in ("linear", "dynamic"):
        derived, key = derived * spec.factor, f"{key} x rope_scaling factor"
    if options.disable_sliding_window and any(window):
        derived, key = min(min(w for w in window if w), derived), "sliding_window"
    derived = int(derived)
    if options.max_model_len is None:
        return derived
    if options.max_model_len > derived and os.environ.get(ALLOW_LONG_ENV) != "1":
        raise ConfigError(f"--max-model-len={options.max_model_len} is greater than the model's "
                          f"maximum length ({key}={derived}); set {ALLOW_LONG_ENV}=1 to allow it")
    return options.max_model_len


def _resolve_dtype(requested: str, c) -> str:
    """vLLM's --dtype: auto = the checkpoint's dtype, float32 checkpoints in bfloat16."""
    # (not `torch_dtype`: transformers 5 keeps it as an alias that logs a deprecation warning
    # in the user's first run)
    ckpt = getattr(c, "dtype", None) or "float32"
    ckpt = str(ckpt).removeprefix("torch.")
    model_type = getattr(c, "model_type", "")
    if requested == "auto":
        if ckpt == "float16" and model_type in _NO_FLOAT16:
            return "bfloat16"
        return ckpt if ckpt in ("bfloat16", "float16") else "bfloat16"
    dtype = _DTYPE_NAMES.get(requested, requested)
    if dtype == "float16" and model_type in _NO_FLOAT16:
        raise ConfigError(f"--dtype={requested}: {model_type} overflows in float16; use "
                          "bfloat16 or float32")
    return dtype
