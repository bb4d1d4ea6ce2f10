#!/usr/bin/env python3
"""Training throughput of the reference framework (PyTorch on CPU) on the same models, batch
size, optimizer and data as `ringtmp bench-compute`, for the comparisons in docs/BENCHMARKS.md
(issue 16.3: the cnn against oneDNN, which PyTorch's CPU convolutions run on).

Not a project dependency: `pip install torch numpy` (the wheel is large), then, from the
repository root:
    python3 benches/reference/torch_throughput.py --threads 1 --models mlp,cnn
    python3 benches/reference/torch_throughput.py --threads 2 --models cnn --channels-last

One process measures one thread count. The step is forward, cross-entropy, backward and an
SGD-momentum update (momentum 0.9, rate 0.01, as bench-compute) on real MNIST batches of 64,
after 5 untimed warm-up steps; the median of the timed repeats (40 steps each) is printed, as
ringtmp's benchmark does. Subnormals are flushed, as ringtmp's kernels do.
"""
import argparse
import gzip
import os
import statistics
import time

import numpy as np
import torch
from torch import nn


def load_mnist(root):
    with gzip.open(os.path.join(root, "train-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(root, "train-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = (images.astype(np.float32) / 255.0 - 0.1307) / 0.3081
    return torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))


def build(name):
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                             nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if name == "mlp-deep":
        body = [nn.Flatten(), nn.Linear(784, 1024), nn.ReLU()]
        for _ in range(7):
            body += [nn.Linear(1024, 1024), nn.ReLU()]
        return nn.Sequential(*body, nn.Linear(1024, 10))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    raise SystemExit(f"unknown model {name}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--channels-last", action="store_true", help="NHWC activations (as ringtmp's)")
    p.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "../../data/mnist"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    x_all, y_all = load_mnist(a.data)
    print(f"torch {torch.__version__}, {a.threads} thread(s), mkldnn {torch.backends.mkldnn.is_available()}, "
          f"{'channels-last' if a.channels_last else 'channels-first'}")
    print(f"{'model':<10} {'threads':>7} {'batch':>6} {'samples/s':>14} {'(min..max)':>14}")
    for name in a.models.split(","):
        torch.manual_seed(1)
        model = build(name)
        fmt = torch.channels_last if a.channels_last and name == "cnn" else torch.contiguous_format
        model = model.to(memory_format=fmt)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        batches = x_all.shape[0] // a.batch_size
        step = 0

        def one():
            nonlocal step
            i = (step % batches) * a.batch_size
            xb = x_all[i:i + a.batch_size].contiguous(memory_format=fmt)
            yb = y_all[i:i + a.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            step += 1

        for _ in range(a.warmup):
            one()
        rates = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            for _ in range(a.steps):
                one()
            rates.append(a.steps * a.batch_size / (time.perf_counter() - t))
        print(f"{name:<10} {a.threads:>7} {a.batch_size:>6} {statistics.median(rates):>14.0f} "
              f"{min(rates):>7.0f}..{max(rates):<7.0f}")


if __name__ == "__main__":
    main()
