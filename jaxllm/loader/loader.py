"""`load_model`: the load config and model options -> (decoder with sharded weights,
ModelConfig)."""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import ConfigError
from jaxllm.engine_config import LoadConfig, ModelOptions
from jaxllm.layers.backends import make_backend
from jaxllm.layers.backends.cpu import build_projection_kernels
from jaxllm.loader import hf, sharded_state
from jaxllm.loader.bert_weights import load_encoder, read_encoder_state
from jaxllm.loader.weights import load_weights, param_shardings
from jaxllm.models.decoder import Decoder, abstract_decoder, init_decoder
from jaxllm.models.model_config import ModelConfig

logger = logging.getLogger("jaxllm")


def model_path(load: LoadConfig) -> str:
    """A local folder or .gguf file for --model (a path, or a hub snapshot). The default
    model's name is resolved to its file before: at start-up (resolve_model)."""
    path = os.path.expanduser(load.model)
    if os.path.exists(path):
        return path
    if path.endswith(".gguf"):
        raise ConfigError(f"--model {load.model!r}: no such file")
    return hf.download(load)


def load_format(load: LoadConfig, path: str) -> str:
    """--load-format, with auto resolved: gguf for a .gguf file, else the folder's weight files
    decide (safetensors, else pt)."""
    fmt = load.load_format
    if fmt in ("auto", "sharded_state") and sharded_state.is_sharded_state(path):
        return "sharded_state"
    if fmt == "sharded_state":
        raise ConfigError(f"--load-format=sharded_state: {path} is not a sharded_state folder "
                          f"(no {sharded_state.MARKER}; `jaxllm convert` writes one)")
    if fmt == "auto" and path.endswith(".gguf"):
        return "gguf"
    if fmt not in ("auto", "dummy") and (fmt == "gguf") != path.endswith(".gguf"):
        raise ConfigError(f"--load-format={fmt} cannot read {path}")
    return fmt


# config.json model types transformers does not know, whose architecture is one it does:
# Kimi-K2 ships DeepSeek-V3's configuration code (auto_map) under model_type kimi_k2, which
# AutoConfig would only read by running that code; transformers' own class reads it instead.
CONFIG_ALIASES = {"kimi_k2": "deepseek_v3"}


def _model_type(path: str):
    """The model_type of a folder's config.json (None: no such file, or none given)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None


def hf_config(path: str):
    """The transformers config of a model folder or GGUF file."""
    if path.endswith(".gguf"):
        from jaxllm.loader.gguf import gguf_hf_config
        return gguf_hf_config(path)
    from transformers import CONFIG_MAPPING, AutoConfig
    try:
        alias = CONFIG_ALIASES.get(_model_type(path))
        if alias is not None:
            return CONFIG_MAPPING[alias].from_pretrained(path)
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {path}: cannot read its config.json: {e}") from e


def load_model(load: LoadConfig, options: ModelOptions,
               mesh: Mesh) -> tuple[Decoder, ModelConfig]:
    """The model of `load` (load.model: a path or hub name) built with `options`, its weights
    placed (sharded) on `mesh`, and its config."""
    t0 = time.perf_counter()
    path = model_path(load)
    fmt = load_format(load, path)
    if fmt == "sharded_state":
        options = sharded_state.options_for(path, options)
    kernels = _kernel_builder(mesh)
    try:
        cfg = ModelConfig.from_hf(hf_config(path), options)
        if cfg.encoder is not None:  # BERT, RoBERTa: jaxllm/loader/bert_weights.py
            return load_encoder(load, options, mesh, cfg, path, fmt)
        _check_expert_parallel(cfg, mesh)
        backend = kernels.submit(make_backend, options.attention_backend, mesh,
                                 cfg.num_experts > 0, cfg.quant)
    finally:
        kernels.shutdown(wait=False)
    t_config = time.perf_counter()
    model = abstract_decoder(cfg)  # the weights' shapes, whatever the backend
    if fmt == "dummy":
        shardings = param_shardings(nnx.state(model), mesh)
        return init_decoder(cfg, options.seed, backend.result(), shardings), cfg
    state = _read(load, path, fmt, cfg, mesh)
    t_weights = time.perf_counter()
    backend = backend.result()
    logger.debug("Load: config %.2f s, weights %.2f s, then %.2f s waiting for the kernels' "
                 "build", t_config - t0, t_weights - t_config, time.perf_counter() - t_weights)
    return nnx.merge(nnx.graphdef(abstract_decoder(cfg, backend)), state), cfg


def _read(load: LoadConfig, path: str, fmt: str, cfg: ModelConfig, mesh: Mesh) -> nnx.State:
    """The weights of the checkpoint at `path` (not dummy ones), placed on `mesh`."""
    if fmt == "sharded_state":
        return sharded_state.restore(path, cfg, mesh)
    tensors, where = _checkpoint(path, fmt, cfg)
    return load_weights(abstract_decoder(cfg), tensors, mesh, where=where,
                        progress=load.use_tqdm_on_load)


def _checkpoint(path: str, fmt: str, cfg: ModelConfig) -> tuple:
    """The checkpoint's (HF name, array) pairs, and where each comes from (for errors)."""
    if fmt == "gguf":
        from jaxllm.loader.gguf import iter_gguf_tensors
        kept = cfg.quant.checkpoint_format if cfg.quant and cfg.quant.method == "gguf" else None
        return iter_gguf_tensors(path, kept), path
    fmt, files = hf.weight_files(path, fmt)
    origins: dict[str, str] = {}
    return (hf.iter_weight_files(files, fmt, origins),
            lambda name: origins.get(name, path))


def read_weights(load: LoadConfig, cfg: ModelConfig, mesh: Mesh, seed: int = 0,
                 tensors: Optional[Iterable[tuple[str, np.ndarray]]] = None) -> nnx.State:
    """The weights of a started model (`cfg`, from `load`), in the loader's layout and placed
    on `mesh`: read again from its checkpoint (load.model, resolved; dummy weights made again
    from `seed`), or from `tensors`, a whole checkpoint's (HF name, array) pairs (new weights:
    sleep mode, RL loops)."""
    if cfg.encoder is not None:
        return read_encoder_state(load, cfg, mesh, seed, tensors)
    model = abstract_decoder(cfg)
    if tensors is None and load_format(load, load.model) == "dummy":
        return nnx.state(init_decoder(cfg, seed, shardings=param_shardings(nnx.state(model),
                                                                            mesh)))
    if tensors is None:
        return _read(load, load.model, load_format(load, load.model), cfg, mesh)
    return load_weights(model, tensors, mesh, where="the new weights")


def weight_bytes(model: Decoder) -> dict[str, int]:
    """Bytes of weights resident on the model's first device, by dtype name (int4 weights,
    stored two a byte as uint8, named int4; MXFP4 values and e8m0 scales, uint8, mxfp4)."""
    quant = model.cfg.quant
    packed = quant is not None and quant.weight_dtype in ("int4", "mxfp4")
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(nnx.state(model)):
        shard = leaf.addressable_shards[0].data
        name = quant.weight_dtype if packed and shard.dtype == jnp.uint8 else shard.dtype.name
        out[name] = out.get(name, 0) + shard.nbytes
    return out


def describe_weights(sizes: dict[str, int]) -> str:
    """'3.90 GiB per device: int4 3.40, bfloat16 0.50' (largest first; `weight_bytes`)."""
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    parts = ", ".join(f"{k} {gib(v)}" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1]))
    return f"{gib(sum(sizes.values()))} GiB per device: {parts}"


def _check_expert_parallel(cfg: ModelConfig, mesh: Mesh) -> None:
    """Expert parallelism shards the experts over the tensor-parallel devices (`model` axis),
    as vLLM's EP size is TP x DP: the experts must divide evenly."""
    n = mesh.shape["model"]
    if cfg.expert_parallel and cfg.num_experts % n:
        raise ConfigError(f"--enable-expert-parallel: {cfg.num_experts} experts do not divide "
                          f"over {n} devices (--tensor-parallel-size {n})")


def _kernel_builder(mesh: Mesh) -> ThreadPoolExecutor:
    """Threads that make the backend while the config and weights load: on one CPU device
    that builds the native kernels (g++, seconds each on a cold cache), the dense projection
    kernels from the start, before the config says what else the model needs."""
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxllm-kernels")
    if jax.default_backend() == "cpu" and mesh.size == 1:
        pool.submit(build_projection_kernels, experts=False)
    return pool
