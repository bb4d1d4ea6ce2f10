#!/usr/bin/env python3
"""PyTorch's transformer block (nanoGPT's, GELU in its tanh form) forward and backward at the
dimensions of crates/ringtmp-model/tests/block_speed.rs, on 1 and 2 threads: the best of 7 runs.

    pip install torch
    python3 benches/reference/block_speed.py
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        split = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


def main():
    for seq, width, heads, samples in [(64, 128, 4, 12), (256, 384, 6, 4)]:
        for threads in [1, 2]:
            torch.set_num_threads(threads)
            block = Block(width, heads)
            x = torch.randn(samples, seq, width, requires_grad=True)
            dy = torch.randn(samples, seq, width)
            best = float("inf")
            for _ in range(7):
                started = time.perf_counter()
                block(x).backward(dy)
                best = min(best, time.perf_counter() - started)
            print(
                f"torch T={seq} C={width} H={heads} n={samples} threads={threads}: "
                f"{best * 1e3:.2f} ms per fwd+bwd, {samples * seq / best:.0f} tokens/s"
            )


if __name__ == "__main__":
    main()
