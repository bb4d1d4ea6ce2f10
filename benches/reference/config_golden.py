"""Golden parameter counts for ringtmp's reading of `config.json`: tiny random configurations of
each architecture ringtmp runs (Llama with grouped-query attention and llama3 RoPE scaling, tied
and untied; Qwen 2 with its biases; Qwen 3 with its q/k norms; GPT-2), each built by
`transformers` and counted (`model.num_parameters()`, a tied head counted once). Writes
`configs/parameters.json`.

    pip install transformers torch
    python3 benches/reference/config_golden.py
"""

import json
import pathlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM

CONFIGS = [
    {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 256,
     "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"model_type": "llama", "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 6,
     "num_key_value_heads": 1, "intermediate_size": 80, "vocab_size": 100, "tie_word_embeddings": False,
     "head_dim": 16, "rope_scaling": {"type": "linear", "factor": 2.0}},
    {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 150, "max_position_embeddings": 512,
     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "vocab_size": 120,
     "max_position_embeddings": 512, "tie_word_embeddings": False},
    {"model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 90},
]


def main():
    out = []
    for config in CONFIGS:
        c = AutoConfig.for_model(**config)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(c)
        out.append({"config": config, "parameters": model.num_parameters()})
    path = pathlib.Path(__file__).parent / "configs" / "parameters.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}: {[o['parameters'] for o in out]}")


if __name__ == "__main__":
    main()
