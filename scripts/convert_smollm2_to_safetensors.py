"""Write the default SmolLM2 GGUF out as an HF safetensors folder.

Peers that read only safetensors (vLLM, transformers without gguf) then run the very weights
jaxllm runs by default. transformers dequantizes the GGUF; the config is jaxllm's
`gguf_hf_config` (architectures set, rms_norm_eps 1e-5 rather than its float32 rounding).

    python scripts/convert_smollm2_to_safetensors.py --out /tmp/smollm2 --dtype float32
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxllm.loader.default_model import default_model_path
from jaxllm.loader.gguf import gguf_hf_config


def convert(out: str, dtype: str) -> None:
    """Save config.json, model.safetensors, generation_config.json and tokenizer files to `out`."""
    path = default_model_path()
    folder, name = os.path.split(path)
    config = gguf_hf_config(path)
    config.rope_theta = config.rope_parameters["rope_theta"]  # transformers 4.x reads only this
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config,
                                                  dtype=getattr(torch, dtype))
    # transformers refuses to save a model loaded from GGUF (its GGUF quantizer is marked not
    # serializable, and would write `quantization_config: gguf`), so copy its dense weights into
    # a plain model.
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the saved weights")
    args = parser.parse_args()
    convert(args.out, args.dtype)
    print(f"wrote {sorted(os.listdir(args.out))} to {args.out}")


if __name__ == "__main__":
    main()
