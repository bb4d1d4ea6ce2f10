"""Golden directory for ringtmp's Hugging Face reader: `hf-tiny/`, a model directory as
`transformers` saves one, sharded in two (`model.safetensors.index.json`), with tensors in f32,
f16 and bf16, and `expected.safetensors` holding every tensor's values in f32 (f16 and bf16
widen exactly, so the reader must give these bits).

    pip install safetensors numpy
    python3 benches/reference/hf_golden.py
"""

import json
import pathlib
import struct

import numpy as np
from safetensors.numpy import save_file

OUT = pathlib.Path(__file__).parent / "hf-tiny"
rng = np.random.default_rng(20261205)


def write_shard(path, tensors):
    """A safetensors file written by hand (numpy has no bf16): `tensors` maps a name to its
    dtype name and raw little-endian bytes, in order, with its shape."""
    header, blobs, at = {}, [], 0
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def bf16_exact(shape):
    v = rng.standard_normal(shape).astype(np.float32)
    return (v.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    embed = rng.standard_normal((8, 4)).astype(np.float32)
    norm = rng.standard_normal(4).astype(np.float16)
    q = rng.standard_normal((4, 4)).astype(np.float16)
    head = bf16_exact((8, 4))
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": norm},
              str(OUT / "model-00001-of-00002.safetensors"))
    # The second shard mixes a bf16 and an f16 tensor.
    write_shard(OUT / "model-00002-of-00002.safetensors", {
        "lm_head.weight": ("BF16", head.shape, (head.view(np.uint32) >> 16).astype(np.uint16).tobytes()),
        "model.layers.0.self_attn.q_proj.weight": ("F16", q.shape, q.tobytes()),
    })
    index = {
        "metadata": {"total_size": 32 * 4 + 4 * 2 + 32 * 2 + 16 * 2},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
            "model.layers.0.self_attn.q_proj.weight": "model-00002-of-00002.safetensors",
        },
    }
    (OUT / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (OUT / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 8, "vocab_size": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, indent=2) + "\n")
    save_file({
        "model.embed_tokens.weight": embed,
        "model.norm.weight": norm.astype(np.float32),
        "lm_head.weight": head,
        "model.layers.0.self_attn.q_proj.weight": q.astype(np.float32),
    }, str(OUT / "expected.safetensors"))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
