"""A sequence classifier's head (`--convert classify`): the checkpoint's `score` projection
[num_labels, hidden] and how its logits become probabilities, as vLLM's classify pooler does.

The head is one small matmul on the pooled (last-token) hidden state, so it runs on the host
in float32 and never enters a compiled program. The activation follows transformers'
`problem_type` as vLLM aligns with it: regression keeps the logits, multi-label classification
takes a sigmoid per label, otherwise one label is a sigmoid and several a softmax.
`use_activation=False` (per request, or --pooler-config) returns the raw logits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from jaxllm.config import ConfigError
from jaxllm.loader import hf

HEAD = "score.weight"
HEAD_BIAS = "score.bias"


@dataclass(frozen=True)
class ClassifierHead:
    weight: np.ndarray            # float32 [num_labels, hidden]
    bias: Optional[np.ndarray]    # float32 [num_labels] (none in the decoders' heads)
    id2label: dict                # label index -> name
    problem_type: Optional[str] = None

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        out = self.weight @ hidden.astype(np.float32)
        return out if self.bias is None else out + self.bias

    def probs(self, hidden: np.ndarray, use_activation: bool = True,
              score: bool = False) -> np.ndarray:
        """The head on one pooled hidden state [E] -> [num_labels]. score: a cross-encoder's
        relevance (sigmoid whatever problem_type, as vLLM's score activation)."""
        z = self.logits(hidden).astype(np.float64)
        if not use_activation or (self.problem_type == "regression" and not score):
            return z.astype(np.float32)
        if score or self.num_labels < 2 or self.problem_type == "multi_label_classification":
            return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)
        e = np.exp(z - z.max())
        return (e / e.sum()).astype(np.float32)

    def label(self, probs: np.ndarray) -> Optional[str]:
        """The name of the most likely label (None when the config names none)."""
        return self.id2label.get(int(np.argmax(probs)))


def read_classifier_head(path: str, load_format: str = "auto") -> ClassifierHead:
    """The head of the checkpoint at `path` (a folder); a ConfigError naming --convert when it
    has none (a causal LM's checkpoint: its LM head is no classifier)."""
    if not os.path.isdir(path):
        raise ConfigError(f"--convert classify: {path} is not a checkpoint folder with a "
                          f"classification head ({HEAD})")
    fmt, files = hf.weight_files(path, "auto" if load_format == "dummy" else load_format)
    tensors = _read(files, fmt, (HEAD, HEAD_BIAS))
    if HEAD not in tensors:
        raise ConfigError(f"--convert classify: {path} has no classification head ({HEAD}); "
                          f"it needs a *ForSequenceClassification checkpoint (use --convert "
                          f"embed to pool this model's hidden states)")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    weight = np.asarray(tensors[HEAD], np.float32)
    names = {int(k): v for k, v in (config.get("id2label") or {}).items()}
    bias = tensors.get(HEAD_BIAS)
    return ClassifierHead(weight, None if bias is None else np.asarray(bias, np.float32),
                          names, config.get("problem_type"))


def _read(files: list[str], fmt: str, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Only the named tensors: safetensors reads them alone; a .bin file is read whole."""
    out = {}
    if fmt == "safetensors":
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="np") as f:
                for name in set(names) & set(f.keys()):
                    out[name] = f.get_tensor(name)
        return out
    for name, array in hf.iter_weight_files(files, fmt, {}):
        if name in names:
            out[name] = array
    return out
