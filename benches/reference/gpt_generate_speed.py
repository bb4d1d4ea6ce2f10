#!/usr/bin/env python3
"""PyTorch generating from a GPT preset as nanoGPT's `sample.py` does (its `generate`: the context
cropped to the model's, a full forward for every token, the last position's logits over the
temperature, top-k, a multinomial draw), beside `ringtmp generate` (a KV cache per attention,
the last half of the context encoded again when it fills). Prints the decoding rate in tokens/s
after the first token. The weights are random: the rate does not depend on them.

    pip install torch numpy
    python3 benches/reference/gpt_generate_speed.py --model gpt-small --threads 1
"""
import argparse
import time

import torch
import torch.nn.functional as F

from gpt_train_speed import PRESETS, Gpt


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-small", choices=PRESETS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=65)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    blocks, heads, width, context, _ = PRESETS[args.model]
    model = Gpt(args.vocab, blocks, heads, width, context).eval()
    idx = torch.zeros((1, 1), dtype=torch.long)
    first = None
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(args.tokens):
            cond = idx if idx.size(1) <= context else idx[:, -context:]
            logits = model(cond)[:, -1, :] / args.temperature
            if args.top_k:
                v, _ = torch.topk(logits, min(args.top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, token), dim=1)
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    rate = (args.tokens - 1) / (end - first)
    print(f"{args.model} threads {args.threads}: first token after {first - start:.3f} s, "
          f"then {rate:.1f} tokens/s (torch {torch.__version__})")


if __name__ == "__main__":
    main()
