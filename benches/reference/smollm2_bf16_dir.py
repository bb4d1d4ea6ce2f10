"""Writes the shared SmolLM2 GGUF file as a Hugging Face directory in bf16 (as the model is
published on the Hub), for `ringtmp generate --pretrained DIR` to read bf16 weights from:

    pip install torch transformers gguf accelerate
    python3 benches/reference/smollm2_bf16_dir.py OUT_DIR
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF = os.path.join(os.path.dirname(__file__), "../../../shared/models")
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main():
    out = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(GGUF, gguf_file=NAME)
    loaded = AutoModelForCausalLM.from_pretrained(GGUF, gguf_file=NAME, dtype=torch.float32)
    # A model loaded from GGUF refuses to be saved: the same weights in a model of its config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()})
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print("wrote", out)


if __name__ == "__main__":
    main()
