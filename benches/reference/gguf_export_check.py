"""Checks a file written by `ringtmp export --to gguf`: the `gguf` package reads every tensor
back (dequantised with `gguf.quants.dequantize`), and `transformers` loads the file
(dequantised to f32, its tokenizer from the file's metadata) with the logits that
`ringtmp predict --pretrained FILE` writes for a chat prompt, and answers the prompt.

    pip install torch transformers gguf numpy
    ringtmp export --checkpoint RUN --to gguf OUT.gguf --dtype q8_0
    python3 benches/reference/gguf_export_check.py OUT.gguf [path/to/ringtmp]
"""

import os
import subprocess
import sys
import tempfile

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    path = os.path.abspath(sys.argv[1])
    binary = sys.argv[2] if len(sys.argv) > 2 else "target/release/ringtmp"
    torch.set_num_threads(2)
    reader = gguf.GGUFReader(path)
    kinds = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert values.size == int(np.prod(t.shape)), t.name
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    print(f"gguf {gguf.__version__ if hasattr(gguf, '__version__') else ''} reads "
          f"{len(reader.tensors)} tensors: {kinds}")
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
        gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([binary, "predict", "--pretrained", path, "--prompt-ids",
                        ",".join(map(str, ids)), "--logits", f"{tmp}/l.npy"], check=True)
        got = np.load(f"{tmp}/l.npy")
    print(f"{len(ids)} prompt tokens; logits differ by at most {np.abs(got - want).max():.2e}")
    print("transformers answers:", repr(tok.decode(gen[0, len(ids):])))


if __name__ == "__main__":
    main()
