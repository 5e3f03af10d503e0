"""Multimodal checkpoints loaded for their language model: each architecture's tensor name ->
the text model's (None: a vision tower, projector or MTP tensor, skipped), and those served
with their vision tower, names normalized."""

from __future__ import annotations

from jaxllm.loader import gemma4_weights
from jaxllm.models import gemma3_vision
from jaxllm.models.qwen2_5_vl import checkpoint_name


def _language_model_name(name: str):
    """A Gemma 3 multimodal checkpoint's tensor name -> the text model's (None: a vision tower
    or projector tensor, skipped). Published checkpoints say language_model.model.*,
    transformers 4.5x saved model.language_model.*."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")):
        return None
    return name  # anything else is checked against the targets as it is


def _llama4_text_name(name: str):
    """A Llama 4 multimodal checkpoint's name -> the text model's (None: its vision model,
    skipped); otherwise as Gemma 3's."""
    if name.startswith(("vision_model.", "model.vision_model.")):
        return None
    return _language_model_name(name)


def _qwen3_5_text_name(name: str):
    """A Qwen3.5 (-MoE) multimodal checkpoint's name -> the text model's (None: its vision
    tower, or the multi-token-prediction head, which nothing here runs, skipped); otherwise as
    Gemma 3's."""
    if name.startswith(("model.visual.", "visual.", "mtp.")):
        return None
    return _language_model_name(name)


# Multimodal architectures loaded text-only: checkpoint name -> text model name (or None);
# and those with their vision tower, names normalized.
TEXT_NAMES = {"Gemma3ForConditionalGeneration": gemma3_vision.checkpoint_name,
              "Llama4ForConditionalGeneration": _llama4_text_name,
              "Qwen2_5_VLForConditionalGeneration": checkpoint_name,
              "Qwen3VLForConditionalGeneration": checkpoint_name,  # the same prefixes
              "Qwen3VLMoeForConditionalGeneration": checkpoint_name,
              "Qwen3_5ForConditionalGeneration": _qwen3_5_text_name,
              "Qwen3_5MoeForConditionalGeneration": _qwen3_5_text_name,
              "Gemma4ForConditionalGeneration": gemma4_weights.text_name}
