#!/usr/bin/env python3
"""PyTorch running a model `ringtmp export --to pytorch` wrote: imports its model.py, loads its
model.safetensors with safetensors.torch.load_file into model.build() (strict: every name and
shape must match), and writes the module's outputs for the given inputs as an .npy, so they can
be compared with `ringtmp predict --logits` on the same checkpoint and inputs.

Inputs are raw values as the training files stored them: images [N, H, W] or [N, H, W, C]
(channels last, as NumPy and ringtmp's .npy inputs are; moved to channels first here), tables
[N, columns], or token ids [N, seq] for a language model.

    pip install torch numpy safetensors
    ringtmp export --checkpoint RUN OUT/
    python3 benches/reference/export_parity.py OUT/ inputs.npy torch_logits.npy

The golden files of crates/ringtmp-cli/tests/golden/export/ were made this way (see the test
`exported_models_give_pytorch_the_same_logits` in crates/ringtmp-cli/tests/export.rs).
"""
import importlib.util
import sys

import numpy as np
import safetensors.torch
import torch


def main():
    export_dir, inputs_path, out_path = sys.argv[1:4]
    spec = importlib.util.spec_from_file_location("model", f"{export_dir}/model.py")
    model_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model_py)
    model = model_py.build()
    model.load_state_dict(safetensors.torch.load_file(f"{export_dir}/model.safetensors"))
    model.eval()
    raw = np.load(inputs_path)
    with torch.no_grad():
        if hasattr(model_py, "preprocess"):
            x = raw.astype(np.float32)
            if len(model_py.INPUT_SHAPE) == 3:
                c, h, w = model_py.INPUT_SHAPE
                x = x.reshape(len(x), h, w, c).transpose(0, 3, 1, 2)
            out = model_py.to_targets(model(model_py.preprocess(x)))
        else:
            out = model(torch.as_tensor(raw.astype(np.int64)))
    np.save(out_path, out.numpy().astype(np.float32))
    print(f"{out_path}: outputs {tuple(out.shape)} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
