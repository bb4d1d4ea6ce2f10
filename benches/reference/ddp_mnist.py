#!/usr/bin/env python3
"""The reference framework's data-parallel training (PyTorch DistributedDataParallel over gloo, CPU)
on the job `ringtmp train --strategy allreduce --nodes 4` runs, for the comparison in
docs/BENCHMARKS.md (issue 12): `mlp` (784-1024-1024-1024-10, He-normal weights, zero biases), MNIST
normalised as ringtmp does, 4 processes × batch 64, SGD with momentum 0.9 at 0.04 (0.01 × 4
workers, ringtmp's default), evaluation on the test set every `--eval-every` steps on rank 0
(off the training clock, as in ringtmp).

Not a project dependency: `pip install torch numpy`, then from the repository root:
    python3 benches/reference/ddp_mnist.py --workers 4 --steps 300
    python3 benches/reference/ddp_mnist.py --workers 4 --epochs 3 --eval-every 25   # time to 97%

Each process gets cores ÷ workers intra-op threads, as ringtmp's nodes do. Prints samples/s on
the training clock (rank 0's) and the first training time at which the test accuracy reached the
target.
"""
import argparse
import gzip
import os
import time

import numpy as np


def load(root, split):
    prefix = "train" if split == "train" else "t10k"
    with gzip.open(os.path.join(root, f"{prefix}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 784)
    with gzip.open(os.path.join(root, f"{prefix}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = (images.astype(np.float32) / 255.0 - 0.1307) / 0.3081
    return x, labels.astype(np.int64)


def worker(rank, args):
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(max(1, os.cpu_count() // args.workers))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.workers)
    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x, y = load(args.data, "train")
    tx, ty = (torch.from_numpy(a) for a in load(args.data, "test"))
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    global_batch = args.batch * args.workers
    per_epoch = len(x) // global_batch
    total = args.steps or per_epoch * args.epochs
    rng = np.random.default_rng(args.seed)
    train_s, reached, step = 0.0, None, 0
    order = None
    while step < total:
        if step % per_epoch == 0:
            order = torch.from_numpy(rng.permutation(len(x)))
        t0 = time.perf_counter()
        b = order[(step % per_epoch) * global_batch:][:global_batch]
        mine = b[rank * args.batch:(rank + 1) * args.batch]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x[mine]), y[mine])
        loss.backward()
        opt.step()
        train_s += time.perf_counter() - t0
        step += 1
        due = args.eval_every and (step % args.eval_every == 0 or step == total)
        if due and rank == 0 and reached is None:
            with torch.no_grad():
                acc = (model(tx).argmax(1) == ty).float().mean().item()
            if acc >= args.target:
                reached = (step, train_s, acc)
        if due:
            dist.barrier()
    if rank == 0:
        sps = step * global_batch / train_s
        print(f"ddp gloo: {args.workers} workers x {args.batch}: {step} steps, "
              f"{sps:.0f} samples/s (training clock {train_s:.1f} s)")
        if args.eval_every:
            if reached:
                print(f"reached {args.target:.1%} at step {reached[0]} after {reached[1]:.1f} s "
                      f"of training (test accuracy {reached[2]:.2%})")
            else:
                print(f"did not reach {args.target:.1%}")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.04)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (else --epochs)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--target", type=float, default=0.97)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--data", default="data/mnist")
    args = p.parse_args()
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(args,), nprocs=args.workers, join=True)


if __name__ == "__main__":
    main()
