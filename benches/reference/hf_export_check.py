"""Checks a directory written by `ringtmp export --to hf` against transformers: the model and
tokenizer load with `AutoModelForCausalLM` / `AutoTokenizer`, and the logits transformers
computes for a chat prompt equal those `ringtmp predict --pretrained DIR` writes.

    pip install torch transformers safetensors numpy
    ringtmp export --checkpoint RUN --to hf OUT
    python3 benches/reference/hf_export_check.py OUT [path/to/ringtmp]
"""

import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    out = sys.argv[1]
    binary = sys.argv[2] if len(sys.argv) > 2 else "target/release/ringtmp"
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
        gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([binary, "predict", "--pretrained", out, "--prompt-ids",
                        ",".join(map(str, ids)), "--logits", f"{tmp}/l.npy"], check=True)
        got = np.load(f"{tmp}/l.npy")
    print(f"{len(ids)} prompt tokens; logits differ by at most {np.abs(got - want).max():.2e}")
    print("transformers answers:", repr(tok.decode(gen[0, len(ids):])))


if __name__ == "__main__":
    main()
