"""`--load-format sharded_state`: a model's loaded weights saved with orbax-checkpoint, in the
loader's layout (fused, quantized, decoded from GGUF: the checkpoint-reading work done once;
the backend's re-layout still runs at start-up), and restored straight into their placement on
the device mesh: each host reads only the shards its devices hold (orbax restores to the
target shardings). vLLM's format of the same name saves per-rank files for one tensor-parallel
size; this one restores to any mesh.

A folder written by `jaxllm convert MODEL OUT` (`save`) holds:
  state/                  the orbax checkpoint of the model's weights (`Decoder`'s state)
  config.json             the model's transformers config (GGUF metadata included)
  jaxllm_sharded_state.json  what the weights were converted with (dtype, quantization)
  the tokenizer and generation_config.json of the source model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxllm.engine_config import ConfigError, ModelOptions
from jaxllm.loader.weights import param_shardings
from jaxllm.models.decoder import Decoder, abstract_decoder
from jaxllm.models.model_config import ModelConfig

MARKER = "jaxllm_sharded_state.json"
STATE = "state"


def _orbax():
    """orbax.checkpoint, imported when first needed: importing it adds a stderr handler to the
    root logger, which would print jaxllm's log lines again in Python's default format; that
    handler is taken out."""
    root = logging.getLogger()
    before = list(root.handlers)
    import orbax.checkpoint as ocp
    for handler in root.handlers[:]:
        if handler not in before:
            root.removeHandler(handler)
    return ocp


def is_sharded_state(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def save(model: Decoder, cfg: ModelConfig, options: ModelOptions, hf_config, out: str,
         tokenizer=None, source: str = "") -> None:
    """Write the loaded `model` (its weights as placed now, sharded or not) and what loading
    it again needs into the folder `out` (created; it must not hold a checkpoint already)."""
    ocp = _orbax()
    if os.path.exists(os.path.join(out, STATE)):
        raise ConfigError(f"{out}: already holds a sharded_state checkpoint")
    os.makedirs(out, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(os.path.join(out, STATE)), nnx.to_pure_dict(nnx.state(model)))
    hf_config.to_json_file(os.path.join(out, "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    gen = os.path.join(source, "generation_config.json")
    if os.path.isdir(source) and os.path.isfile(gen):
        shutil.copy(gen, out)
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump({"dtype": cfg.dtype, "quantization": options.quantization,
                   "source": source}, f, indent=1)


def options_for(path: str, options: ModelOptions) -> ModelOptions:
    """The model options a sharded_state folder is read with: the dtype and quantization it
    was converted with (the weights hold them), which the user's flags may repeat but not
    change."""
    with open(os.path.join(path, MARKER)) as f:
        saved = json.load(f)
    if options.dtype not in ("auto", saved["dtype"]):
        raise ConfigError(f"--dtype={options.dtype}: {path} holds {saved['dtype']} weights "
                          f"(convert the model again to change it)")
    if options.quantization not in (None, saved["quantization"]):
        raise ConfigError(f"--quantization={options.quantization}: {path} was converted with "
                          f"--quantization={saved['quantization']}")
    return dataclasses.replace(options, dtype=saved["dtype"],
                               quantization=saved["quantization"])


def restore(path: str, cfg: ModelConfig, mesh: Mesh) -> nnx.State:
    """The weights of a sharded_state folder, each array restored into its sharding on
    `mesh` (of any size: not the one it was saved from)."""
    ocp = _orbax()
    state = nnx.state(abstract_decoder(cfg))
    shardings = nnx.to_pure_dict(param_shardings(state, mesh))
    target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          nnx.to_pure_dict(state), shardings)
    with ocp.StandardCheckpointer() as ckpt:
        try:
            restored = ckpt.restore(os.path.abspath(os.path.join(path, STATE)), target)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{path}: its sharded_state does not fit {cfg.architecture} as "
                              f"configured: {e}") from e
    nnx.replace_by_pure_dict(state, restored)
    return state
