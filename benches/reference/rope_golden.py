"""Golden rotary embeddings for ringtmp's RoPE: `transformers`' Llama rotary embedding
(`LlamaRotaryEmbedding` and `apply_rotary_pos_emb`, rotate-half convention) for three
configurations — the default frequencies, linear scaling and Llama 3's scaling — on random
queries at positions 0..15 and a far one. Writes `rope/rope.json` (float32 values).

    pip install transformers torch
    python3 benches/reference/rope_golden.py
"""

import json
import pathlib

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

CASES = [
    {"name": "default", "rope_theta": 10000.0, "rope_scaling": None},
    {"name": "linear", "rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    {"name": "llama3", "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}},
]
HEADS, HEAD_DIM = 2, 32
POSITIONS = list(range(8)) + [5000, 70000]


def main():
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, len(POSITIONS), HEAD_DIM)
    out = {"heads": HEADS, "head_dim": HEAD_DIM, "positions": POSITIONS,
           "q": q.flatten().tolist(), "cases": []}
    for case in CASES:
        config = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                             max_position_embeddings=131072, rope_theta=case["rope_theta"],
                             rope_scaling=case["rope_scaling"])
        rope = LlamaRotaryEmbedding(config)
        position_ids = torch.tensor([POSITIONS])
        cos, sin = rope(q, position_ids)
        rotated, _ = apply_rotary_pos_emb(q, q, cos, sin)
        out["cases"].append({**case, "inv_freq": rope.inv_freq.tolist(),
                             "rotated": rotated.flatten().tolist()})
    path = pathlib.Path(__file__).parent / "rope" / "rope.json"
    path.write_text(json.dumps(out) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
