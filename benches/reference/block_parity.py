#!/usr/bin/env python3
"""ringtmp's transformer block against PyTorch's (nanoGPT's Block with GELU in its tanh form).

Both sides make the same inputs and parameters from a formula (sin of the index, in float64,
rounded to float32), so nothing but this script's output crosses between them. PyTorch runs the
block forward, then backward from the objective L = sum(y * r); the outputs, the input gradient
and every parameter's gradient go to a golden JSON file that ringtmp's test
(crates/ringtmp-model/tests/torch_parity.rs) compares with its own, so the check runs where
torch is not installed.

    pip install torch numpy
    python3 benches/reference/block_parity.py > crates/ringtmp-model/tests/golden/block_torch.json
"""
import json
import math

import numpy as np
import torch
import torch.nn.functional as F

N, T, C, H, RATIO = 2, 5, 8, 2, 4


def values(count, salt, scale, offset=0.0):
    i = np.arange(count, dtype=np.float64)
    return (np.sin(i * 0.37 + salt) * scale + offset).astype(np.float32)


# GPT-2's tensors in ringtmp's order, each with its salt, scale and offset.
TENSORS = [
    ("ln_1.weight", (C,), 0.1, 1.0),
    ("ln_1.bias", (C,), 0.1, 0.0),
    ("attn.c_attn.weight", (3 * C, C), 0.3, 0.0),
    ("attn.c_attn.bias", (3 * C,), 0.1, 0.0),
    ("attn.c_proj.weight", (C, C), 0.3, 0.0),
    ("attn.c_proj.bias", (C,), 0.1, 0.0),
    ("ln_2.weight", (C,), 0.1, 1.0),
    ("ln_2.bias", (C,), 0.1, 0.0),
    ("mlp.c_fc.weight", (RATIO * C, C), 0.3, 0.0),
    ("mlp.c_fc.bias", (RATIO * C,), 0.1, 0.0),
    ("mlp.c_proj.weight", (C, RATIO * C), 0.3, 0.0),
    ("mlp.c_proj.bias", (C,), 0.1, 0.0),
]


def main():
    torch.set_default_dtype(torch.float32)
    params = {}
    for k, (name, shape, scale, offset) in enumerate(TENSORS):
        v = values(math.prod(shape), 1.0 + k, scale, offset)
        params[name] = torch.tensor(v.reshape(shape), requires_grad=True)
    x = torch.tensor(values(N * T * C, 0.5, 1.0).reshape(N, T, C), requires_grad=True)
    r = torch.tensor(values(N * T * C, 5.0, 1.0).reshape(N, T, C))
    p = params

    def attn(h):
        qkv = F.linear(h, p["attn.c_attn.weight"], p["attn.c_attn.bias"])
        q, k, v = qkv.split(C, dim=2)
        heads = lambda t: t.view(N, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        y = y.transpose(1, 2).contiguous().view(N, T, C)
        return F.linear(y, p["attn.c_proj.weight"], p["attn.c_proj.bias"])

    def mlp(h):
        u = F.linear(h, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"])
        return F.linear(F.gelu(u, approximate="tanh"), p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])

    ln = lambda h, w, b: F.layer_norm(h, (C,), p[w], p[b], eps=1e-5)
    x2 = x + attn(ln(x, "ln_1.weight", "ln_1.bias"))
    y = x2 + mlp(ln(x2, "ln_2.weight", "ln_2.bias"))
    (y * r).sum().backward()
    flat = lambda t: [float(v) for v in t.detach().reshape(-1).tolist()]
    out = {
        "about": "benches/reference/block_parity.py, torch " + torch.__version__,
        "samples": N,
        "seq": T,
        "width": C,
        "heads": H,
        "mlp_ratio": RATIO,
        "y": flat(y),
        "dx": flat(x.grad),
        "grads": {name: flat(params[name].grad) for name, *_ in TENSORS},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
