#!/usr/bin/env python3
"""A small GPT trained by PyTorch from ringtmp's initial weights on ringtmp's batches.

The model is nanoGPT's (token and position embeddings, pre-norm blocks with GELU in its tanh
form, a final LayerNorm, an LM head), with ringtmp's two choices: the head has a bias and is not
tied to the token embedding. The optimizer is torch.optim.AdamW with two parameter groups, as
nanoGPT makes them but with embeddings undecayed (ringtmp's default): every tensor of two or more
dimensions but the embeddings decays, biases, norms and embeddings do not. Each step clips the
gradient to a global norm with torch.nn.utils.clip_grad_norm_ and sets the learning rate ringtmp's
schedule gives (read from the inputs). The per-step training losses, and the gradient norms
before clipping, go to a golden JSON file that crates/ringtmp-strategy/tests/gpt_parity.rs
compares with ringtmp's own run.

Inputs (written by that test under RINGTMP_BLESS=1): tests/golden/gpt_parity/init.safetensors
(ringtmp's checkpoint format, read here without the safetensors package) and batches.json.

    pip install torch numpy
    python3 benches/reference/gpt_parity.py > crates/ringtmp-strategy/tests/golden/gpt_torch.json
"""
import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
INPUTS = os.path.join(HERE, "../../crates/ringtmp-strategy/tests/golden/gpt_parity")


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", meta
        start, end = meta["data_offsets"]
        out[name] = torch.from_numpy(
            np.frombuffer(body[start:end], dtype="<f4").reshape(meta["shape"]).copy()
        )
    return out


class Gpt(torch.nn.Module):
    def __init__(self, weights, blocks, heads):
        super().__init__()
        self.blocks, self.heads = blocks, heads
        # Only the model's tensors (the checkpoint also holds the optimizer's state).
        self.p = torch.nn.ParameterDict(
            {
                name.replace(".", "_"): torch.nn.Parameter(t)
                for name, t in weights.items()
                if name.startswith("layers.")
            }
        )

    def w(self, name):
        return self.p[name.replace(".", "_")]

    def forward(self, idx):
        n, t = idx.shape
        x = self.w("layers.0.wte.weight")[idx] + self.w("layers.0.wpe.weight")[:t]
        c = x.shape[-1]
        for b in range(1, self.blocks + 1):
            pre = f"layers.{b}."
            ln = lambda h, k: F.layer_norm(
                h, (c,), self.w(pre + k + ".weight"), self.w(pre + k + ".bias"), eps=1e-5
            )
            h = ln(x, "ln_1")
            qkv = F.linear(h, self.w(pre + "attn.c_attn.weight"), self.w(pre + "attn.c_attn.bias"))
            q, k, v = qkv.split(c, dim=2)
            split = lambda z: z.view(n, t, self.heads, c // self.heads).transpose(1, 2)
            y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
            y = y.transpose(1, 2).contiguous().view(n, t, c)
            x = x + F.linear(y, self.w(pre + "attn.c_proj.weight"), self.w(pre + "attn.c_proj.bias"))
            h = ln(x, "ln_2")
            u = F.gelu(F.linear(h, self.w(pre + "mlp.c_fc.weight"), self.w(pre + "mlp.c_fc.bias")), approximate="tanh")
            x = x + F.linear(u, self.w(pre + "mlp.c_proj.weight"), self.w(pre + "mlp.c_proj.bias"))
        norm = self.blocks + 1
        x = F.layer_norm(
            x, (c,), self.w(f"layers.{norm}.weight"), self.w(f"layers.{norm}.bias"), eps=1e-5
        )
        head = self.blocks + 2
        return F.linear(x, self.w(f"layers.{head}.weight"), self.w(f"layers.{head}.bias"))


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with open(os.path.join(INPUTS, "batches.json")) as f:
        inputs = json.load(f)
    model = Gpt(
        read_safetensors(os.path.join(INPUTS, "init.safetensors")),
        inputs["blocks"],
        inputs["heads"],
    )
    named = list(model.p.items())
    embedding = lambda name: "_wte_" in name or "_wpe_" in name
    decay = [p for name, p in named if p.dim() >= 2 and not embedding(name)]
    rest = [p for name, p in named if not (p.dim() >= 2 and not embedding(name))]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": inputs["weight_decay"]},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=1.0,
        betas=tuple(inputs["betas"]),
        eps=inputs["eps"],
        foreach=False,
    )
    n, t, v = inputs["batch"], inputs["seq"], inputs["vocab"]
    losses, norms = [], []
    for step in inputs["steps"]:
        x = torch.tensor(step["x"], dtype=torch.long).view(n, t)
        y = torch.tensor(step["y"], dtype=torch.long).view(n, t)
        for group in optimizer.param_groups:
            group["lr"] = step["lr"]
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, v), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), inputs["clip"])
        optimizer.step()
        losses.append(loss.item())
        norms.append(float(norm))
    print(
        json.dumps(
            {
                "about": "benches/reference/gpt_parity.py, torch " + torch.__version__,
                "losses": losses,
                "grad_norms": norms,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
