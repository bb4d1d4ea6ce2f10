"""What quantising the vector that meets each weight matrix does to SmolLM2's greedy answer, in
PyTorch: transformers loads the GGUF file (dequantised to f32), every `Linear`'s input is
quantised in blocks of 32 to LEVELS levels each side (127: 8 bits, llama.cpp's; 32767: 16 bits,
ringtmp's default), and the chat prompt is answered greedily.

    pip install torch transformers gguf
    python3 benches/reference/activation_precision_sim.py ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf 127
"""

import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def quantised(x, levels):
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    return ((blocks * inv).round().clamp(-levels, levels) * (amax / levels)).reshape(x.shape)


def main():
    path, levels = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, args: (quantised(args[0], levels),))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    print(f"{levels} levels: {tok.decode(out[0, ids.shape[1]:])!r}")


if __name__ == "__main__":
    main()
