"""Loading an encoder-only model (BERT, RoBERTa, XLM-RoBERTa; jaxllm/models/bert.py): what
start-up refuses for it, and its checkpoint's tensors -> the model's stacked weights.

A checkpoint names the encoder's tensors with its prefix (`bert.`, `roberta.`) in a
*ForSequenceClassification or *ForMaskedLM checkpoint and without it in a bare BertModel one
(most sentence-transformers folders); old TF-converted checkpoints name LayerNorm weights
gamma/beta. Tensors of heads the pooling runner does not run (masked-LM and next-sentence
heads: `cls.`, `lm_head.`) are skipped, as are the classifier head and BERT's pooler, which
the pooler reads itself (jaxllm/loader/classifier_head.py), and the position/token type id
buffers some checkpoints keep. Any other tensor, or a missing one, is an error.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.config import ConfigError
from jaxllm.engine_config import LoadConfig, ModelOptions
from jaxllm.loader import hf
from jaxllm.models.bert import LAYER_SHAPES, BertEncoder, top_shapes
from jaxllm.models.model_config import ModelConfig

_TOP = {"embeddings.word_embeddings.weight": "word",
        "embeddings.position_embeddings.weight": "position",
        "embeddings.token_type_embeddings.weight": "token_type",
        "embeddings.LayerNorm.weight": "emb_norm_w", "embeddings.LayerNorm.bias": "emb_norm_b"}
_LAYER = {"attention.self.query.weight": "wq", "attention.self.query.bias": "bq",
          "attention.self.key.weight": "wk", "attention.self.key.bias": "bk",
          "attention.self.value.weight": "wv", "attention.self.value.bias": "bv",
          "attention.output.dense.weight": "wo", "attention.output.dense.bias": "bo",
          "attention.output.LayerNorm.weight": "ln1_w", "attention.output.LayerNorm.bias": "ln1_b",
          "intermediate.dense.weight": "wi", "intermediate.dense.bias": "bi",
          "output.dense.weight": "wout", "output.dense.bias": "bout",
          "output.LayerNorm.weight": "ln2_w", "output.LayerNorm.bias": "ln2_b"}
_LAYER_NAME = re.compile(r"encoder\.layer\.(\d+)\.(.+)")
# Tensors the encoder does not run: heads (read by the pooler, or not used by pooling) and
# the id buffers of the embeddings.
_SKIPPED = ("cls.", "lm_head.", "classifier.", "pooler.", "embeddings.position_ids",
            "embeddings.token_type_ids")


def check_encoder_options(cfg: ModelConfig, options: ModelOptions, mesh: Mesh) -> ModelConfig:
    """Refuse by name what the encoder does not implement; the config with max_model_len
    capped to the position embeddings (RoBERTa's max_position_embeddings counts its padding
    offset, which no prompt token uses)."""
    arch = cfg.architecture
    if mesh.size > 1:
        raise ConfigError(f"--tensor-parallel-size / --pipeline-parallel-size: {arch} "
                          f"(encoder-only) is not sharded; run it on one device (give "
                          f"--data-parallel-size for replicas)")
    if options.lora is not None:
        raise ConfigError(f"--enable-lora: LoRA adapters are not supported for {arch} "
                          "(encoder-only)")
    if options.quantization is not None or cfg.quant is not None:
        raise ConfigError(f"--quantization / a quantized checkpoint: {arch} (encoder-only) "
                          "runs float weights only")
    if options.attention_backend not in ("auto", "reference"):
        raise ConfigError(f"--attention-backend {options.attention_backend}: {arch} "
                          "(encoder-only, bidirectional) runs its dense attention on the "
                          "reference (XLA) path only; use auto or reference")
    if options.kv_cache_dtype != "auto" or options.calculate_kv_scales:
        raise ConfigError(f"--kv-cache-dtype / --calculate-kv-scales: {arch} (encoder-only) "
                          "keeps no KV cache")
    if options.rope_scaling or options.rope_theta:
        raise ConfigError(f"--rope-scaling / --rope-theta: {arch} (encoder-only) has learned "
                          "absolute positions, no RoPE")
    limit = cfg.encoder.max_positions
    if cfg.max_model_len > limit:
        if options.max_model_len is not None:
            raise ConfigError(f"--max-model-len={options.max_model_len} is greater than "
                              f"{arch}'s {limit} position embeddings")
        cfg = dataclasses.replace(cfg, max_model_len=limit)
    return cfg


def encoder_weights(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]],
                    where: str) -> dict[str, np.ndarray]:
    """The model's weights by name (`BertEncoder`'s), float in the model's dtype, from a
    checkpoint's (name, array) pairs; a ConfigError naming an unknown or missing tensor."""
    L, prefix = cfg.num_layers, cfg.encoder.prefix + "."
    dt = cfg.jnp_dtype
    top: dict[str, np.ndarray] = {}
    layers: dict[str, list] = {name: [None] * L for name in LAYER_SHAPES}
    for name, array in tensors:
        short = name[len(prefix):] if name.startswith(prefix) else name
        short = short.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias")
        if name.startswith(_SKIPPED) or short.startswith(_SKIPPED):
            continue
        w = np.asarray(array, np.float32)
        m = _LAYER_NAME.fullmatch(short)
        if short in _TOP:
            top[_TOP[short]] = w
        elif m and m.group(2) in _LAYER and int(m.group(1)) < L:
            key = _LAYER[m.group(2)]
            layers[key][int(m.group(1))] = w.T if key.startswith("w") else w  # torch [out, in]
        else:
            raise ConfigError(f"{where}: tensor {name!r} is not part of {cfg.architecture}")
    missing = [n for n in top_shapes(cfg) if n not in top] + [
        f"encoder.layer.{i}: {n}" for n, ws in layers.items() for i, w in enumerate(ws)
        if w is None]
    if missing:
        raise ConfigError(f"{where}: {cfg.architecture} checkpoint lacks {missing[:4]}"
                          f"{' ...' if len(missing) > 4 else ''}")
    out = {n: w.astype(dt) for n, w in top.items()}
    out.update({n: np.stack(ws).astype(dt) for n, ws in layers.items()})
    return out


def _placed(weights: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    sharding = NamedSharding(mesh, P())
    return {n: jax.device_put(w, sharding) for n, w in weights.items()}


def load_encoder(load: LoadConfig, options: ModelOptions, mesh: Mesh, cfg: ModelConfig,
                 path: str, fmt: str) -> tuple[BertEncoder, ModelConfig]:
    """The encoder of the checkpoint at `path` (weights on `mesh`) and its config."""
    cfg = check_encoder_options(cfg, options, mesh)
    return BertEncoder(cfg, weights=_read(load, path, fmt, cfg, mesh, options.seed)), cfg


def read_encoder_state(load: LoadConfig, cfg: ModelConfig, mesh: Mesh, seed: int = 0,
                       tensors: Optional[Iterable[tuple[str, np.ndarray]]] = None
                       ) -> nnx.State:
    """A started encoder's weights read again (sleep mode), or from `tensors` (new weights)."""
    if tensors is not None:
        weights = _placed(encoder_weights(cfg, tensors, "the new weights"), mesh)
    else:
        weights = _read(load, load.model, load.load_format, cfg, mesh, seed)
    return nnx.state(BertEncoder(cfg, weights=weights))


def _read(load: LoadConfig, path: str, fmt: str, cfg: ModelConfig, mesh: Mesh,
          seed: int) -> Optional[dict[str, jax.Array]]:
    if fmt == "dummy":
        return _placed(BertEncoder(cfg, seed).weights(), mesh)
    if fmt not in ("auto", "safetensors", "pt"):
        raise ConfigError(f"--load-format={fmt}: {cfg.architecture} (encoder-only) loads "
                          "safetensors or PyTorch checkpoints only")
    fmt, files = hf.weight_files(path, fmt)
    return _placed(encoder_weights(cfg, hf.iter_weight_files(files, fmt, {}), path), mesh)

