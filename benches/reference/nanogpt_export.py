#!/usr/bin/env python3
"""nanoGPT itself running what `ringtmp export --to nanogpt` wrote.

Loads OUT/ckpt.pt with torch.load (weights_only, torch's default), builds nanoGPT's GPT from its
model_args with nanoGPT's own model.py, loads the state dict (strict), and writes the logits for
the token ids of IDS.npy ([rows, seq]) twice: with nanoGPT's exact (erf) GELU, and with the
tanh GELU ringtmp computes (the one difference between the two models), so that each can be
compared with `ringtmp predict --logits` on the same checkpoint. It then takes the optimizer
state as nanoGPT's train.py --init_from=resume does (configure_optimizers, load_state_dict) and
makes one step, and decodes the ids with OUT/meta.pkl when there is one.

    pip install torch numpy
    git clone https://github.com/karpathy/nanoGPT NANOGPT
    ringtmp export --to nanogpt --checkpoint RUN OUT/
    ringtmp predict --checkpoint RUN --data-file IDS.npy --logits ringtmp_logits.npy
    python3 benches/reference/nanogpt_export.py OUT/ IDS.npy ringtmp_logits.npy NANOGPT \
        [torch_logits.npy]

The last argument, when given, receives the tanh-GELU log-probabilities (the golden file of
crates/ringtmp-cli/tests/golden/export/nanogpt/ was made this way).
"""
import pickle
import sys

import numpy as np
import torch


def main():
    export_dir, ids_path, ringtmp_path, nanogpt_dir = sys.argv[1:5]
    golden = sys.argv[5] if len(sys.argv) > 5 else None
    sys.path.insert(0, nanogpt_dir)
    import model as nanogpt

    checkpoint = torch.load(f"{export_dir}/ckpt.pt", map_location="cpu")
    config = nanogpt.GPTConfig(**checkpoint["model_args"])
    model = nanogpt.GPT(config)
    model.load_state_dict(checkpoint["model"])
    model.eval()
    ids = torch.from_numpy(np.load(ids_path).astype(np.int64))
    ours = np.load(ringtmp_path)

    def all_logits():
        # nanoGPT's forward without targets returns the last position's logits only.
        with torch.no_grad():
            logits, _ = model(ids, targets=ids)
        return logits.numpy()

    exact = all_logits()
    for block in model.transformer.h:
        block.mlp.gelu = torch.nn.GELU(approximate="tanh")
    tanh = all_logits()
    # The head's bias travels in ln_f's bias up to one constant per position, which the
    # softmax does not see: the log-probabilities are what must agree.
    q = torch.log_softmax(torch.from_numpy(ours), -1)
    for name, theirs in (("tanh GELU", tanh), ("nanoGPT's erf GELU", exact)):
        p = torch.log_softmax(torch.from_numpy(theirs), -1)
        worst = float((p - q).abs().max())
        kl = float((p.exp() * (p - q)).sum(-1).mean())
        print(
            f"{name}: log-probabilities differ by at most {worst:.3e}; "
            f"mean KL(nanoGPT || ringtmp) {kl:.3e} nats"
        )
    if golden:
        np.save(golden, torch.log_softmax(torch.from_numpy(tanh), -1).numpy().astype(np.float32))

    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")
    optimizer.load_state_dict(checkpoint["optimizer"])
    model.train()
    for block in model.transformer.h:
        block.mlp.gelu = torch.nn.GELU()
    _, loss = model(ids[:, :-1].contiguous(), targets=ids[:, 1:].contiguous())
    loss.backward()
    optimizer.step()
    print(
        f"train.py's resume: optimizer state loaded ({len(optimizer.param_groups)} groups), "
        f"one step at loss {loss.item():.4f}; iter_num {checkpoint['iter_num']}"
    )
    try:
        with open(f"{export_dir}/meta.pkl", "rb") as f:
            meta = pickle.load(f)
        text = "".join(meta["itos"][int(i)] for i in ids[0])
        assert [meta["stoi"][c] for c in text] == ids[0].tolist()
        print(f"meta.pkl: {meta['vocab_size']} characters; ids[0] reads {text!r}")
    except FileNotFoundError:
        print("no meta.pkl (not a character model)")


if __name__ == "__main__":
    main()
