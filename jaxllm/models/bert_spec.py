"""`EncoderSpec`: what an encoder-only model (BERT, RoBERTa, XLM-RoBERTa) has beyond the
shared `ModelConfig` fields, read from its transformers config once and carried in
`ModelConfig.encoder` (jaxllm/models/bert.py runs it; None for every decoder).

Kept apart from jaxllm/models/bert.py so that the registry (imported by the model config)
can build it without importing the model.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxllm.config import ConfigError

# architecture -> (checkpoint prefix of the encoder's weights, classifier head kind or None).
# The head kinds: "bert" is BertForSequenceClassification's (bert.pooler dense + tanh on [CLS],
# then `classifier`), "roberta" RobertaClassificationHead (classifier.dense + tanh on <s>,
# then classifier.out_proj).
ENCODER_ARCHITECTURES = {
    "BertModel": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert"),
    "RobertaModel": ("roberta", None),
    "RobertaForSequenceClassification": ("roberta", "roberta"),
    "XLMRobertaModel": ("roberta", None),
    "XLMRobertaForSequenceClassification": ("roberta", "roberta"),
}


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    prefix: str                  # "bert" or "roberta": the checkpoint's weight-name prefix
    head: Optional[str]          # classifier head kind (ENCODER_ARCHITECTURES), None: embed
    type_vocab_size: int         # token type (segment) embeddings
    layer_norm_eps: float
    max_positions: int           # position embeddings a prompt may use
    # RoBERTa: positions count the non-pad tokens from padding_idx + 1 (transformers'
    # create_position_ids_from_input_ids); None: BERT's 0, 1, 2, ...
    padding_idx: Optional[int] = None

    @property
    def position_offset(self) -> int:
        return 0 if self.padding_idx is None else self.padding_idx + 1

    @classmethod
    def from_hf(cls, c, arch: str) -> "EncoderSpec":
        prefix, head = ENCODER_ARCHITECTURES[arch]
        kind = getattr(c, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ConfigError(f"{arch}: position_embedding_type={kind!r} is not supported "
                              "(absolute only)")
        if getattr(c, "is_decoder", False) or getattr(c, "add_cross_attention", False):
            raise ConfigError(f"{arch} configured as a decoder (is_decoder / "
                              "add_cross_attention) is not supported: encoder-only models run "
                              "bidirectionally on the pooling runner")
        padding_idx = c.pad_token_id if prefix == "roberta" else None
        if padding_idx is not None and padding_idx < 0:
            raise ConfigError(f"{arch}: pad_token_id={padding_idx} gives no position offset")
        offset = 0 if padding_idx is None else padding_idx + 1
        return cls(prefix, head, int(c.type_vocab_size), float(c.layer_norm_eps),
                   int(c.max_position_embeddings) - offset, padding_idx)


def encoder_features(c, arch: str) -> dict:
    """The `ModelConfig` fields of an encoder-only architecture (the registry's adapter):
    biases on every projection, its EncoderSpec."""
    return dict(qkv_bias=True, o_bias=True, encoder=EncoderSpec.from_hf(c, arch))
