"""The MTP drafter's weights: the checkpoint's `model.layers.{N}.*` tensors (N =
num_hidden_layers), which the target model's loader skips (weights.py's `_past_last_layer`).

Where they go (jaxllm/models/mtp.py's `MtpLayer`): the decoder-layer tensors as layer 0 of a
one-layer model of the target's kind (the target's own tensor layouts, `hf_targets`), and

    model.layers.N.enorm.weight / hnorm.weight     -> enorm / hnorm
    model.layers.N.eh_proj.weight [E, 2E]          -> eh_proj [2E, E]
    model.layers.N.shared_head.norm.weight         -> final_norm
    model.layers.N.shared_head.head.weight         -> lm_head    (optional: else the target's)
    model.layers.N.embed_tokens.weight             -> embed      (optional: else the target's)

Only those tensors are read (safetensors headers are read to find them, then each tensor by
name). Every refusal is a ConfigError naming --speculative-config and the method.
"""

from __future__ import annotations

import dataclasses
import glob
import os

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import ConfigError
from jaxllm.engine_config import LoadConfig
from jaxllm.layers.backends.base import Backend
from jaxllm.loader import hf
from jaxllm.loader.loader import hf_config, load_format, model_path
from jaxllm.loader.quantized import Target
from jaxllm.loader.weights import hf_targets, load_weights, param_shardings
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.mtp import MtpLayer, mtp_config

FLAG = "--speculative-config"
# Architectures whose checkpoints carry an MTP layer in this layout (num_nextn_predict_layers).
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


@dataclasses.dataclass(frozen=True)
class MtpSource:
    """Where the MTP layer is and what it holds: the checkpoint folder and its load format,
    the layer's index N, whether its MLP is a MoE one, and whether it has its own embedding
    and LM head."""
    path: str
    fmt: str
    layer: int
    moe: bool
    own_embed: bool = False
    own_head: bool = False

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer}."


def mtp_source(load: LoadConfig, target: ModelConfig, method: str) -> MtpSource:
    """The MTP layer of the target checkpoint of `load` (the target's, its model resolved),
    or a ConfigError saying why there is none to draft with."""
    why = f"{FLAG}: method {method!r} drafts with the model's own MTP layer"
    if target.architecture not in MTP_ARCHITECTURES:
        raise ConfigError(f"{why}; {target.architecture} has none (supported: "
                          f"{', '.join(MTP_ARCHITECTURES)})")
    path = model_path(load)
    c = hf_config(path)
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    n = getattr(c, "num_nextn_predict_layers", 0) or 0
    if n == 0:
        raise ConfigError(f"{why}, but its config has num_nextn_predict_layers={n}")
    if n > 1:
        raise ConfigError(f"{why}; num_nextn_predict_layers={n}: only checkpoints with one "
                          "MTP layer are supported")
    if target.quant is not None:
        raise ConfigError(f"{why}; quantized MTP layers are not supported")
    N = target.num_layers
    moe = bool(target.num_experts) and N >= (getattr(c, "first_k_dense_replace", 0) or 0)
    fmt = load_format(load, path)
    if fmt == "dummy":  # dummy weights: the layer made, embedding and head shared
        return MtpSource(path, fmt, N, moe)
    if fmt not in ("auto", "safetensors") or not os.path.isdir(path):
        raise ConfigError(f"{why}, which is read from safetensors weights only (load format "
                          f"{fmt!r})")
    names = _tensor_names(path)
    prefix = f"model.layers.{N}."
    if not any(name.startswith(prefix) for name in names):
        raise ConfigError(f"{why}, but the checkpoint has no {prefix}* tensors (its config "
                          "names one; this copy was saved without it)")
    return MtpSource(path, "safetensors", N, moe, own_embed=prefix + "embed_tokens.weight"
                     in names, own_head=prefix + "shared_head.head.weight" in names)


def load_mtp(src: MtpSource, target: ModelConfig, backend: Backend, mesh: Mesh,
             seed: int = 0) -> tuple[MtpLayer, ModelConfig]:
    """The MTP layer with its weights placed on `mesh` (dummy ones for load format dummy),
    and its one-layer ModelConfig."""
    cfg = mtp_config(target, src.moe)
    kw = dict(own_embed=src.own_embed, own_head=src.own_head)
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: MtpLayer(cfg, **kw))  # shapes only
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: MtpLayer(cfg, backend, **kw)))
    shardings = param_shardings(nnx.state(abstract), mesh)
    if src.fmt == "dummy":
        def make():
            with nnx.use_eager_sharding(False):
                return nnx.split(MtpLayer(cfg, backend, seed, **kw))[1]
        return nnx.merge(graphdef, jax.jit(make, out_shardings=shardings)()), cfg
    targets = mtp_targets(src, cfg)
    state = load_weights(abstract, _read(src.path, set(targets)), mesh, where=src.path,
                         targets=targets)
    return nnx.merge(graphdef, state), cfg


def mtp_targets(src: MtpSource, cfg: ModelConfig) -> dict[str, list[Target]]:
    """Checkpoint name -> where it goes (the module docstring's table)."""
    E, prefix = cfg.hidden_size, src.prefix
    renamed = {"model.norm.weight": prefix + "shared_head.norm.weight"}
    if src.own_embed:
        renamed["model.embed_tokens.weight"] = prefix + "embed_tokens.weight"
    if src.own_head:
        renamed["lm_head.weight"] = prefix + "shared_head.head.weight"
    out = {}
    for name, ts in hf_targets(cfg).items():
        if name.startswith("model.layers.0."):
            out[prefix + name[len("model.layers.0."):]] = ts
        elif name in renamed:
            out[renamed[name]] = ts
    same = lambda x: x  # noqa: E731
    out[prefix + "enorm.weight"] = [Target(("enorm",), (0,), (E,), same)]
    out[prefix + "hnorm.weight"] = [Target(("hnorm",), (0,), (E,), same)]
    out[prefix + "eh_proj.weight"] = [Target(("eh_proj",), (0, 0), (E, 2 * E), lambda x: x.T)]
    return out


def _tensor_names(path: str) -> set[str]:
    """Every tensor name of a safetensors checkpoint folder (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in _files(path):
        with safe_open(f, framework="np") as st:
            names.update(st.keys())
    return names


def _files(path: str) -> list[str]:
    try:
        return hf.weight_files(path, "safetensors")[1]
    except ConfigError:
        return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def _read(path: str, wanted: set[str]):
    """(name, array) of the `wanted` tensors only, one at a time."""
    from safetensors import safe_open

    for f in _files(path):
        with safe_open(f, framework="np") as st:
            for name in st.keys():
                if name in wanted:
                    yield name, st.get_tensor(name)
