"""Read a GGUF checkpoint as an HF config plus HF-named float32 tensors.

The tensors feed the same loader as safetensors checkpoints, so everything GGUF-specific is
undone here: llama.cpp's tensor names, its row permutation of Q and K (llama architecture only),
Gemma's `1 + w` norm storage, and quantization (dequantized with the `gguf` package, one tensor at
a time so peak memory stays near one float32 tensor).
"""

from __future__ import annotations

import functools
import os
import re
import struct
from typing import Any, Iterator, Optional

import numpy as np

from jaxllm.loader.gguf_quant import decode, is_projection, kept_type

_LLAMA = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN3 = {**_LLAMA, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3 = {**_QWEN3, "ffn_norm": "pre_feedforward_layernorm",
           "post_attention_norm": "post_attention_layernorm",
           "post_ffw_norm": "post_feedforward_layernorm"}

# Mixture of experts: llama.cpp stacks each layer's experts in one tensor (`*_exps`, [X, ...]);
# they are yielded split, one HF tensor per expert (`{}` = the expert's index).
_MIXTRAL = {**_LLAMA, "ffn_gate_inp": "block_sparse_moe.gate",  # Mixtral is GGUF "llama"
            "ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
            "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
            "ffn_down_exps": "block_sparse_moe.experts.{}.w2"}
_QWEN_MOE = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{}.gate_proj",
             "ffn_up_exps": "mlp.experts.{}.up_proj", "ffn_down_exps": "mlp.experts.{}.down_proj",
             "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
             "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj"}

# GGUF `general.architecture` -> per-layer GGUF name -> HF name under `model.layers.N.`.
BLOCK_NAMES = {"llama": _MIXTRAL, "qwen2": _LLAMA, "qwen3": _QWEN3, "gemma3": _GEMMA3,
               "qwen2moe": {**_LLAMA, **_QWEN_MOE}, "qwen3moe": {**_QWEN3, **_QWEN_MOE}}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
# GGUF architecture -> transformers' model_type and causal-LM class.
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
                "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "mixtral": "mixtral"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                  "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}

# What the `gguf` package and transformers' GGUF reader raise on truncated or corrupt files.
_READ_ERRORS = (OSError, ValueError, IndexError, KeyError, struct.error)

_TENSOR = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<part>\w+)\.(?P<kind>weight|bias)")


class GGUFError(ValueError):
    """A GGUF file jaxllm cannot read; the message names the file (and tensor)."""


def read_gguf(path: str):
    """Open a GGUF file, turning the `gguf` package's low-level errors into one naming the file.

    Cached per (path, size, mtime): parsing SmolLM2's tokenizer metadata takes seconds, and
    start-up reads the config, tensors and EOS id from the same file.
    """
    st = os.stat(path)
    return _read_gguf(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str, size: int, mtime_ns: int):
    try:
        return _plain_view_reader()(path)
    except _READ_ERRORS as e:
        raise GGUFError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from e


@functools.lru_cache(maxsize=1)
def _plain_view_reader():
    """`gguf.GGUFReader` over a plain ndarray view of its memory map.

    The reader parses metadata with one small slice per value (hundreds of thousands for a
    typical vocabulary), and every slice of an `np.memmap` runs its Python
    `__array_finalize__`: over the same mapping as a plain ndarray the parse is several times
    faster (docs/performance.md has the figure). Tensor data are still views into the file."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return Reader


def gguf_value(reader, key: str, default: Any = None) -> Any:
    """One metadata value (scalar, string or list), or `default` when the key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_config(path: str):
    """The HF config of a GGUF file, built from its metadata with the `gguf` package.

    Not `AutoConfig.from_pretrained(folder, gguf_file=...)`: from transformers 5.24 that imports
    torch, which the plain install does not have. `AutoConfig.for_model` (a config class, no
    torch) fills in the architecture's defaults for what GGUF does not record (Gemma 3's layer
    pattern and local RoPE base). `rms_norm_eps` is rounded back from float32 (GGUF stores 1e-5
    as 9.9999997e-06).
    """
    from transformers import AutoConfig

    reader = read_gguf(path)
    arch = gguf_value(reader, "general.architecture")
    if arch not in BLOCK_NAMES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(BLOCK_NAMES))})")

    def meta(key: str, default=None):
        return gguf_value(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tokens = gguf_value(reader, "tokenizer.ggml.tokens") or ()
    kwargs = dict(
        num_hidden_layers=meta("block_count"), hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"), num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv", heads),
        head_dim=meta("attention.key_length", hidden // heads),
        max_position_embeddings=meta("context_length"),
        vocab_size=meta("vocab_size") or len(tokens),
        rms_norm_eps=float(str(np.float32(meta("attention.layer_norm_rms_epsilon", 1e-6)))),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors))
    model_type = _moe_config(arch, meta, kwargs)
    kwargs["architectures"] = [_ARCHITECTURES[model_type]]
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        kwargs["rope_scaling"] = {"rope_type": scaling, "factor": float(meta("rope.scaling.factor")),
                                  "original_max_position_embeddings":
                                      meta("rope.scaling.original_context_length")}
    if meta("attention.sliding_window") is not None:
        kwargs["sliding_window"] = meta("attention.sliding_window")
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = gguf_value(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            kwargs[f"{name}_token_id"] = int(token_id)
    missing = [k for k, v in kwargs.items() if v is None]
    if missing:
        raise GGUFError(f"{path}: metadata lacks what {', '.join(missing)} is read from")
    config = AutoConfig.for_model(_MODEL_TYPES[model_type], **kwargs)
    kept = kept_type(reader.tensors)
    if kept is not None:  # read by ModelConfig as a checkpoint's quantization_config
        config.quantization_config = {"quant_method": "gguf", "weight_type": kept}
    return config


def _moe_config(arch: str, meta, kwargs: dict) -> str:
    """Add the mixture-of-experts fields (if the file has experts) to `kwargs`; returns the
    key of _MODEL_TYPES (a GGUF "llama" with experts is Mixtral). Routing as llama.cpp does it:
    Qwen3-MoE renormalizes the top-k weights, Qwen2-MoE does not; every layer is sparse."""
    experts = meta("expert_count")
    if not experts:
        return arch
    used = meta("expert_used_count")
    if arch == "llama":
        kwargs.update(num_local_experts=experts, num_experts_per_tok=used)
        return "mixtral"
    ffn = meta("expert_feed_forward_length")
    kwargs.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=ffn,
                  norm_topk_prob=arch == "qwen3moe", mlp_only_layers=[])
    if kwargs["intermediate_size"] is None:  # no dense layer: nothing reads it
        kwargs["intermediate_size"] = ffn
    if arch == "qwen2moe":
        kwargs["shared_expert_intermediate_size"] = meta("expert_shared_feed_forward_length")
    return arch


def iter_gguf_tensors(path: str, kept: Optional[str] = None
                      ) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(hf_name, float32 array)` in HF's [out, in] layout, one dequantized tensor at a time.
    kept: the block type of the decoder projections when the model keeps them quantized
    (`gguf_quant.kept_type`): each is yielded as its values (int8 [out, in]) under its name,
    its scales and, for Q4_1, its zero points ([out, groups]) as `weight_scale` / `weight_zero`.

    A tied checkpoint has no `output.weight`, so no `lm_head.weight` is yielded, as in HF
    safetensors. Every tensor name is checked before the first is yielded, so an unknown tensor
    fails before anything is loaded.
    """
    from gguf.quants import dequantize

    reader = read_gguf(path)
    arch = gguf_value(reader, "general.architecture")
    if arch not in BLOCK_NAMES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(BLOCK_NAMES))})")
    named = [(t, _hf_name(t.name, BLOCK_NAMES[arch], path, arch)) for t in reader.tensors]
    n_head = gguf_value(reader, f"{arch}.attention.head_count")
    n_kv_head = gguf_value(reader, f"{arch}.attention.head_count_kv", n_head)
    for tensor, hf_name in named:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        part = tensor.name.split(".")[-2]
        if kept is not None and is_projection(tensor.name):
            if tensor.tensor_type.name != kept:
                raise GGUFError(f"{path}: tensor {tensor.name!r} is {tensor.tensor_type.name}, "
                                f"the other projections {kept}")
            base = hf_name[:-len(".weight")]
            arrays = decode(tensor.data, kept, *shape)
            for suffix, a in zip((".weight", ".weight_scale", ".weight_zero"), arrays):
                if a is not None:
                    if arch == "llama" and part in ("attn_q", "attn_k"):
                        a = _unpermute(a, n_head if part == "attn_q" else n_kv_head)
                    yield base + suffix, a
            continue
        try:
            w = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except NotImplementedError as e:
            raise GGUFError(f"{path}: tensor {tensor.name!r}: {e}") from e
        w = w.astype(np.float32, copy=not w.flags.writeable)  # F32 data is a read-only file view
        if arch == "llama" and part in ("attn_q", "attn_k"):
            w = _unpermute(w, n_head if part == "attn_q" else n_kv_head)
        if arch == "gemma3" and part.endswith("norm"):
            w = w - np.float32(1.0)
        if part == "ffn_gate_inp_shexp":  # llama.cpp may store the [1, E] gate as [E]
            w = w.reshape(1, -1)
        if "{}" in hf_name:  # stacked experts: one HF tensor each
            for j in range(w.shape[0]):
                yield hf_name.format(j), w[j]
        else:
            yield hf_name, w


def _hf_name(gguf_name: str, block_names: dict, path: str, arch: str) -> str:
    m = _TENSOR.fullmatch(gguf_name)
    table = GLOBAL_NAMES if m and m["layer"] is None else block_names
    if not m or m["part"] not in table:
        raise GGUFError(f"{path}: tensor {gguf_name!r} has no known HF name for a {arch} model")
    prefix = "" if m["layer"] is None else f"model.layers.{m['layer']}."
    return f"{prefix}{table[m['part']]}.{m['kind']}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (its RoPE pairs rows 2i, 2i+1)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))
