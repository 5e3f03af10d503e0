"""A sequence classifier's head (`--convert classify`): the checkpoint's `score` projection
[num_labels, hidden] and how its logits become probabilities, as vLLM's classify pooler does.

The head is one small matmul on the pooled (last-token) hidden state, so it runs on the host
in float32 and never enters a compiled program. An encoder's head (BERT, RoBERTa: the pooled
[CLS] / <s> state) has a dense layer and tanh before it: BERT's `bert.pooler.dense`, RoBERTa's
`classifier.dense`, then `classifier` / `classifier.out_proj` as the projection.

The activation follows transformers' `problem_type` as vLLM aligns with it: regression keeps
the logits, multi-label classification takes a sigmoid per label, otherwise one label is a
sigmoid and several a softmax.
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
from jaxllm.models.bert_spec import ENCODER_ARCHITECTURES

HEAD = "score.weight"
HEAD_BIAS = "score.bias"
# An encoder classifier's head kind (jaxllm/models/bert_spec.py) -> (its dense layer's, its
# projection's) tensor-name prefixes.
ENCODER_HEADS = {"bert": ("bert.pooler.dense.", "classifier."),
                 "roberta": ("classifier.dense.", "classifier.out_proj.")}


@dataclass(frozen=True)
class ClassifierHead:
    weight: np.ndarray            # float32 [num_labels, hidden]
    bias: Optional[np.ndarray]    # float32 [num_labels] (none in the decoders' heads)
    id2label: dict                # label index -> name
    problem_type: Optional[str] = None
    # float32 ([E, E] torch layout, [E]): an encoder head's dense layer, tanh-activated,
    # before the projection (None: the projection alone)
    dense: Optional[tuple[np.ndarray, np.ndarray]] = None

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        hidden = hidden.astype(np.float32)
        if self.dense is not None:
            hidden = np.tanh(self.dense[0] @ hidden + self.dense[1])
        out = self.weight @ hidden
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


def read_classifier_head(path: str, load_format: str = "auto",
                         hf_overrides: Optional[dict] = None,
                         tokenizer: Optional[str] = None) -> ClassifierHead:
    """The head of the checkpoint at `path` (a folder), its config.json under --hf-overrides;
    a ConfigError naming --convert when it has none (a causal LM's checkpoint: its LM head is
    no classifier, unless `classifier_from_token` makes one of its rows: `tokenizer` is the
    folder that names them, default `path`)."""
    if not os.path.isdir(path):
        raise ConfigError(f"--convert classify: {path} is not a checkpoint folder with a "
                          f"classification head ({HEAD})")
    with open(os.path.join(path, "config.json")) as f:
        config = {**json.load(f), **(hf_overrides or {})}
    fmt, files = hf.weight_files(path, "auto" if load_format == "dummy" else load_format)
    if config.get("classifier_from_token") is not None:
        return _token_head(config, files, fmt, tokenizer or path)
    kind = next((ENCODER_ARCHITECTURES[a][1] for a in config.get("architectures") or ()
                 if a in ENCODER_ARCHITECTURES), None)
    if kind is not None:
        return _encoder_head(path, config, files, fmt, kind)
    tensors = _read(files, fmt, (HEAD, HEAD_BIAS))
    if HEAD not in tensors:
        raise ConfigError(f"--convert classify: {path} has no classification head ({HEAD}); "
                          f"it needs a *ForSequenceClassification checkpoint (use --convert "
                          f"embed to pool this model's hidden states)")
    weight = np.asarray(tensors[HEAD], np.float32)
    names = {int(k): v for k, v in (config.get("id2label") or {}).items()}
    bias = tensors.get(HEAD_BIAS)
    return ClassifierHead(weight, None if bias is None else np.asarray(bias, np.float32),
                          names, config.get("problem_type"))


def _token_head(config: dict, files: list[str], fmt: str, tokenizer: str) -> ClassifierHead:
    """vLLM's LM-head reranker (Qwen3-Reranker: --hf-overrides '{"architectures":
    ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": true}'): the relevance is the softmax of the two tokens'
    logits at the last position, taken for the second; as one label, the head is the
    difference of their LM-head rows under a sigmoid (`from_2_way_softmax`)."""
    tokens, method = config["classifier_from_token"], config.get("method", "from_2_way_softmax")
    if method != "from_2_way_softmax" or not (isinstance(tokens, list) and len(tokens) == 2):
        raise ConfigError(f"--hf-overrides: classifier_from_token {tokens!r} with method "
                          f"{method!r} is not supported (two tokens, from_2_way_softmax: the "
                          "Qwen3-Reranker form)")
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(tokenizer).get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ConfigError(f"--hf-overrides: classifier_from_token {missing} are not tokens of "
                          f"the tokenizer")
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    rows = _read(files, fmt, (head,)).get(head)
    if rows is None:
        raise ConfigError(f"--hf-overrides: classifier_from_token needs the LM head ({head})")
    lo, hi = (np.asarray(rows[vocab[t]], np.float32) for t in tokens)
    return ClassifierHead((hi - lo)[None], None, {0: tokens[1]}, None)


def _encoder_head(path: str, config: dict, files: list[str], fmt: str,
                  kind: str) -> ClassifierHead:
    """An encoder's head: its dense layer (+ tanh) and projection, with their biases."""
    dense, proj = ENCODER_HEADS[kind]
    names = tuple(p + s for p in (dense, proj) for s in ("weight", "bias"))
    tensors = _read(files, fmt, names)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ConfigError(f"--convert classify: {path} lacks its classification head's "
                          f"{', '.join(missing)}")
    t = {n: np.asarray(tensors[n], np.float32) for n in names}
    labels = {int(k): v for k, v in (config.get("id2label") or {}).items()}
    return ClassifierHead(t[proj + "weight"], t[proj + "bias"], labels,
                          config.get("problem_type"),
                          (t[dense + "weight"], t[dense + "bias"]))


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
