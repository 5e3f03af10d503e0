"""Find a Hugging Face checkpoint (local folder or hub snapshot) and read its tensors one by one."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import ml_dtypes  # also registers bfloat16 with NumPy, so safetensors can return it
import numpy as np

from jaxllm.config import ConfigError
from jaxllm.engine_config import LoadConfig
from jaxllm.loader.default_model import check_local_path
from jaxllm.loader.weights import CheckpointError

# Config, tokenizer and generation-config files fetched with the weights.
_META_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_FORMATS = {  # load format -> (file pattern, index file)
    "safetensors": ("*.safetensors", "model.safetensors.index.json"),
    "pt": ("*.bin", "pytorch_model.bin.index.json"),
}
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "scheduler.bin")


def download(load: LoadConfig) -> str:
    """snapshot_download of --model at --revision into --download-dir, weights of --load-format
    only (auto: safetensors, else .bin)."""
    from huggingface_hub import snapshot_download

    check_local_path(load.model)  # a missing path is not a hub name: say so, not the hub's error

    def fetch(weights: list[str]) -> str:
        return snapshot_download(load.model, revision=load.revision, cache_dir=load.download_dir,
                                 allow_patterns=_META_PATTERNS + weights)

    try:
        if load.load_format in ("pt", "dummy"):
            return fetch(["*.bin"] if load.load_format == "pt" else [])
        path = fetch(["*.safetensors"])
        if load.load_format == "auto" and not glob.glob(os.path.join(path, "*.safetensors")):
            path = fetch(["*.bin"])
        return path
    except Exception as e:  # offline, unknown repo, gated, bad revision, ...
        raise ConfigError(f"--model {load.model!r} is not a local path, and getting it from the "
                          f"Hugging Face hub failed: {type(e).__name__}: {e}") from e


def weight_files(folder: str, load_format: str) -> tuple[str, list[str]]:
    """(format, files) of the checkpoint in `folder`; auto prefers safetensors over .bin.

    When an index file exists only the files it names count (some repos also ship e.g. a
    consolidated copy in another layout).
    """
    for fmt, (pattern, index) in _FORMATS.items():
        if load_format not in ("auto", fmt):
            continue
        files = sorted(glob.glob(os.path.join(folder, pattern)))
        index_path = os.path.join(folder, index)
        if os.path.exists(index_path):
            with open(index_path) as f:
                named = set(json.load(f)["weight_map"].values())
            files = [p for p in files if os.path.basename(p) in named]
        files = [p for p in files if os.path.basename(p) not in _NOT_WEIGHTS]
        if files:
            return fmt, files
    raise ConfigError(f"--load-format={load_format}: no weight files for it in {folder}")


def iter_weight_files(files: list[str], fmt: str, origins: dict[str, str]
                      ) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor, one at a time; records name -> file in `origins`."""
    read = _read_safetensors if fmt == "safetensors" else _read_torch
    for path in files:
        try:
            for name, array in read(path):
                origins[name] = path
                yield name, array
        except Exception as e:  # a corrupt or truncated file fails in the reader, not the model
            raise CheckpointError(f"{path}: cannot read this {fmt} file (corrupt or truncated?): "
                                  f"{type(e).__name__}: {e}") from e


# safetensors dtypes its NumPy reader does not know (it looks them up on numpy itself):
# float8 weights and scales of FP8 checkpoints, read from the file's bytes instead.
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _read_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    header = None
    with safe_open(path, framework="np") as f:
        for name in f.keys():
            dtype = _RAW_DTYPES.get(f.get_slice(name).get_dtype())
            if dtype is None:
                yield name, f.get_tensor(name)
                continue
            header = header or _safetensors_header(path)
            info, start = header[0][name], header[1]
            begin, end = info["data_offsets"]
            raw = np.fromfile(path, np.uint8, count=end - begin, offset=start + begin)
            yield name, raw.view(dtype).reshape(info["shape"])


def _safetensors_header(path: str) -> tuple[dict, int]:
    """(the file's JSON header, where its data starts): 8 bytes of header length first."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _read_torch(path: str) -> Iterator[tuple[str, np.ndarray]]:
    try:
        import torch  # only this (legacy) format needs torch
    except ImportError as e:
        raise ConfigError(f"{path}: PyTorch .bin weights need torch, which is not installed "
                          "(pip install torch, or convert them to safetensors)") from e

    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for name in list(state):
        t = state.pop(name)
        if t.dtype == torch.bfloat16:
            yield name, t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            yield name, t.numpy()
