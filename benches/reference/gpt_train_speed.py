#!/usr/bin/env python3
"""PyTorch training a GPT preset on the bundled Shakespeare, as `ringtmp train --strategy local
--dataset text --model gpt-cpu|gpt-small` does: nanoGPT's model (GELU in its tanh form, the head
with a bias and untied, as ringtmp's presets), AdamW (β₂ 0.99, decay 0.1 on matrices but
embeddings), clipping at norm 1, random windows of the character-level corpus (ringtmp's
vocabulary: every character of the first 90%). Prints training tokens/s over the steps after a
warm-up and, with --minutes, trains that long with nanoGPT's schedule (100 warm-up steps, cosine
to a tenth over --steps) and reports the validation loss every --eval-every steps, with the
training seconds it took to get there (evaluations not counted), on the same kind of fixed
validation windows as ringtmp (the first 16,384 tokens of the last 10%, in windows of the context).

    pip install torch numpy
    python3 benches/reference/gpt_train_speed.py --model gpt-cpu --threads 1
    python3 benches/reference/gpt_train_speed.py --model gpt-cpu --threads 2 --minutes 5
"""
import argparse
import gzip
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# nanoGPT's block, GELU in its tanh form: the one block_speed.py times.
from block_speed import Block

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "../../data/shakespeare/shakespeare.txt.gz")
PRESETS = {  # blocks, heads, width, context, batch
    "gpt-nano": (2, 2, 64, 32, 8),
    "gpt-cpu": (4, 4, 128, 64, 12),
    "gpt-small": (6, 6, 384, 256, 64),
}


class Gpt(nn.Module):
    def __init__(self, vocab, blocks, heads, width, context):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * blocks) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-cpu", choices=PRESETS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--timed-steps", type=int, default=60)
    parser.add_argument("--minutes", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--batch", type=int, default=0, help="0: the preset's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(42)
    blocks, heads, width, context, batch = PRESETS[args.model]
    batch = args.batch or batch
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        text = f.read()
    cut = int(len(text) * 0.9)
    chars = sorted(set(text[:cut]))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.int64)
    train, valid = torch.from_numpy(ids[:cut]), torch.from_numpy(ids[cut:])
    starts = torch.arange(0, 16384, context)
    vx = torch.stack([valid[s : s + context] for s in starts])
    vy = torch.stack([valid[s + 1 : s + 1 + context] for s in starts])

    model = Gpt(len(chars), blocks, heads, width, context)
    named = list(model.named_parameters())
    decays = lambda n, p: p.dim() >= 2 and not n.startswith(("wte", "wpe"))
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if decays(n, p)], "weight_decay": 0.1},
            {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.99),
    )

    def lr_at(step):
        base, floor = 1e-3, 1e-4
        rate = floor + (base - floor) * 0.5 * (1 + math.cos(math.pi * min(step / args.steps, 1)))
        return rate * (step + 1) / 100 if step < 100 else rate

    def train_step(step):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        at = torch.randint(len(train) - context - 1, (batch,))
        x = torch.stack([train[s : s + context] for s in at])
        y = torch.stack([train[s + 1 : s + 1 + context] for s in at])
        loss = F.cross_entropy(model(x).view(-1, len(chars)), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    @torch.no_grad()
    def validation_loss():
        model.eval()
        loss = F.cross_entropy(model(vx).view(-1, len(chars)), vy.view(-1)).item()
        model.train()
        return loss

    params = sum(p.numel() for p in model.parameters())
    if args.minutes <= 0:
        for step in range(5):
            train_step(step)
        started = time.perf_counter()
        for step in range(5, 5 + args.timed_steps):
            train_step(step)
        seconds = time.perf_counter() - started
        print(
            f"torch {torch.__version__} {args.model} ({params} parameters) batch {batch} "
            f"context {context} threads {args.threads}: "
            f"{args.timed_steps * batch * context / seconds:.0f} tokens/s"
        )
        return
    trained, step = 0.0, 0
    while trained < args.minutes * 60 and step < args.steps:
        started = time.perf_counter()
        train_step(step)
        trained += time.perf_counter() - started
        step += 1
        if step % args.eval_every == 0 or step == args.steps:
            print(
                f"step {step}: validation loss {validation_loss():.4f} after {trained:.1f} s "
                f"of training",
                flush=True,
            )


if __name__ == "__main__":
    main()
