#!/usr/bin/env python3
"""Training throughput of the reference Python framework (TensorFlow 2.15, CPU) on the same models,
batch size, optimizer and data as `ringtmp bench-compute`, for the comparison in
docs/BENCHMARKS.md.

Not a project dependency: install it in a throw-away virtual environment first, e.g.
    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install "tensorflow-cpu==2.15.*"
then, from the repository root:
    /tmp/tfvenv/bin/python benches/reference/tf_throughput.py --threads 2 --models mlp,cnn

One process measures one thread count (TensorFlow fixes its thread pools at start-up). The step is
a compiled `tf.function` (forward, loss, backward, SGD-momentum update) fed with real MNIST
batches; the median of the timed repeats is printed, as ringtmp's benchmark does.
"""
import argparse
import gzip
import os
import statistics
import sys
import time

import numpy as np


def load_mnist(root):
    with gzip.open(os.path.join(root, "train-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28, 1)
    with gzip.open(os.path.join(root, "train-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = (images.astype(np.float32) / 255.0 - 0.1307) / 0.3081
    return x, labels.astype(np.int64)


def build(tf, name):
    he = tf.keras.initializers.HeNormal()
    layers = tf.keras.layers
    if name == "mlp":
        body = [layers.Flatten()] + [layers.Dense(1024, "relu", kernel_initializer=he) for _ in range(3)]
    elif name == "mlp-deep":
        body = [layers.Flatten()] + [layers.Dense(1024, "relu", kernel_initializer=he) for _ in range(8)]
    elif name == "cnn":
        body = [
            layers.Conv2D(32, 5, activation="relu", kernel_initializer=he),
            layers.MaxPooling2D(2),
            layers.Conv2D(64, 5, activation="relu", kernel_initializer=he),
            layers.MaxPooling2D(2),
            layers.Flatten(),
            layers.Dense(512, "relu", kernel_initializer=he),
        ]
    else:
        sys.exit(f"unknown model {name}")
    return tf.keras.Sequential([tf.keras.Input((28, 28, 1))] + body + [layers.Dense(10)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", default="data/mnist")
    args = parser.parse_args()

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    x, y = load_mnist(args.data)
    rng = np.random.default_rng(1)
    order = rng.permutation(len(y))
    batches = len(y) // args.batch_size

    for name in args.models.split(","):
        model = build(tf, name)
        opt = tf.keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        def batch(i):
            idx = order[(i % batches) * args.batch_size:(i % batches + 1) * args.batch_size]
            return tf.constant(x[idx]), tf.constant(y[idx])

        i = 0
        for _ in range(args.warmup):
            step(*batch(i)).numpy()
            i += 1
        rates = []
        for _ in range(args.repeats):
            feeds = [batch(i + s) for s in range(args.steps)]
            start = time.perf_counter()
            for xb, yb in feeds:
                loss = step(xb, yb)
            loss.numpy()
            rates.append(args.steps * args.batch_size / (time.perf_counter() - start))
            i += args.steps
        print(f"tensorflow {tf.__version__} {name:<9} threads {args.threads} batch {args.batch_size}: "
              f"{statistics.median(rates):.0f} samples/s (min {min(rates):.0f}, max {max(rates):.0f})")


if __name__ == "__main__":
    main()
