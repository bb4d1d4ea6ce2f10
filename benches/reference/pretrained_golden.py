"""Golden files for ringtmp's pretrained-model loaders, made with Hugging Face `transformers`:
ringtmp's tests load the same weights and compare their logits to these.

It writes, under `benches/reference/pretrained/`:

- Five tiny random-weight models, each a directory as `transformers` saves one
  (`save_pretrained(..., safe_serialization=True)`: `config.json`, `generation_config.json`
  and a single, unsharded, f32 `model.safetensors`), plus `golden.safetensors` holding
  `input_ids` (f32 values of int token ids, [2, 12]) and `logits` (f32, [2, 12, 160]): the
  model's logits for both sequences run as one batch, without padding or attention mask.
  - `llama-gqa`: Llama, grouped-query attention (4 heads, 2 key/value heads), llama3 RoPE
    scaling, untied head.
  - `llama-tied`: Llama, multi-query attention (1 key/value head), linear RoPE scaling, head
    tied to the embedding.
  - `qwen2`: Qwen2 (biases on q/k/v), tied head.
  - `qwen3`: Qwen3 (per-head q_norm/k_norm, head_dim 32 != hidden/heads), untied head.
  - `gpt2`: GPT-2 (Conv1D weights stored [in, out], LayerNorm with bias, learned positions,
    gelu_new), tied head.
  Weights are `transformers`' own initialisation with a larger spread (initializer_range
  0.1, so attention is far from uniform and RoPE matters) after a fixed torch seed; then every
  norm gain gets N(0, 0.1) noise and every bias N(0, 0.02), so none is trivially 1 or 0.
- `smollm2-golden.safetensors` and `smollm2-golden.json`: the real SmolLM2-135M-Instruct,
  Q4_1 GGUF (`shared/models/`), loaded by `transformers` dequantised to f32: the chat-templated
  prompt "What is the capital of France?" (`prompt_ids`, [T]), the logits at four prompt
  positions (`logit_rows`, [4]: the first, two inside, the last; `prompt_logits`, [4, 49152]:
  all T rows would be 7 MB), and the greedy answer's new tokens (`answer_ids`,
  [N], up to and including EOS), all f32; the JSON has the rendered prompt, the ids, the
  decoded answer and the package versions.

Deterministic (fixed seeds, one CPU thread).

    pip install torch transformers gguf safetensors numpy accelerate
    python3 benches/reference/pretrained_golden.py
"""

import importlib.metadata
import json
import pathlib

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "pretrained"
GGUF_DIR = HERE.parent.parent.parent / "shared" / "models"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

VOCAB = 160
BATCH, SEQ = 2, 12
INIT_STD = 0.1  # transformers' initializer_range (its default, 0.02, makes attention ~uniform)
NORM_NOISE = 0.1
BIAS_NOISE = 0.02

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=INIT_STD,
)


def configs():
    """(name, model class, config, torch seed) of every tiny model."""
    return [
        ("llama-gqa", LlamaForCausalLM, LlamaConfig(
            **COMMON, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False), 1),
        ("llama-tied", LlamaForCausalLM, LlamaConfig(
            **COMMON, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            tie_word_embeddings=True, attention_bias=False, mlp_bias=False), 2),
        ("qwen2", Qwen2ForCausalLM, Qwen2Config(
            **COMMON, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=True), 3),
        ("qwen3", Qwen3ForCausalLM, Qwen3Config(
            **COMMON, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
            rope_theta=1000000.0, tie_word_embeddings=False), 4),
        # bos/eos set inside the tiny vocabulary (GPT-2's default, 50256, is not).
        ("gpt2", GPT2LMHeadModel, GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            layer_norm_epsilon=1e-5, activation_function="gelu_new",
            initializer_range=INIT_STD, bos_token_id=0, eos_token_id=0), 5),
    ]


def is_norm(module):
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def perturb(model, seed):
    """Noise on every norm gain (std NORM_NOISE) and every bias (std BIAS_NOISE)."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for _, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if pname == "bias":
                    p.add_(torch.randn(p.shape, generator=g) * BIAS_NOISE)
                elif pname == "weight" and is_norm(module):
                    p.add_(torch.randn(p.shape, generator=g) * NORM_NOISE)


def dir_size(path):
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def tiny_models():
    rng = np.random.default_rng(20261207)
    input_ids = torch.from_numpy(rng.integers(0, VOCAB, size=(BATCH, SEQ), dtype=np.int64))
    for name, cls, config, seed in configs():
        torch.manual_seed(seed)
        model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
        perturb(model, seed)
        model.eval()
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        with torch.no_grad():
            logits = model(input_ids).logits.float()
        assert logits.shape == (BATCH, SEQ, VOCAB), logits.shape
        save_file({"input_ids": input_ids.float().contiguous(), "logits": logits.contiguous()},
                  str(out / "golden.safetensors"))
        # The saved directory must give the same logits when transformers loads it back.
        again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        with torch.no_grad():
            diff = (again(input_ids).logits - logits).abs().max().item()
        assert diff == 0.0, (name, diff)
        print(f"{name}: {dir_size(out)} bytes, logits std {logits.std().item():.3f}")


def smollm2():
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME,
                                                 dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 may give a BatchEncoding
        ids = ids["input_ids"]
    ids = [int(i) for i in ids]
    x = torch.tensor([ids], dtype=torch.int64)
    with torch.no_grad():
        logits = model(x).logits[0].float()
        gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=24, pad_token_id=tok.eos_token_id)
    answer = [int(i) for i in gen[0, len(ids):]]
    if tok.eos_token_id in answer:  # cut after the first EOS
        answer = answer[: answer.index(tok.eos_token_id) + 1]
    text = tok.decode(answer, skip_special_tokens=False)
    rows = [0, len(ids) // 3, 2 * len(ids) // 3, len(ids) - 1]
    save_file({
        "prompt_ids": torch.tensor(ids, dtype=torch.float32),
        "logit_rows": torch.tensor(rows, dtype=torch.float32),
        "prompt_logits": logits[rows].contiguous(),
        "answer_ids": torch.tensor(answer, dtype=torch.float32),
    }, str(OUT / "smollm2-golden.safetensors"))
    versions = {p: importlib.metadata.version(p)
                for p in ("torch", "transformers", "gguf", "safetensors", "numpy", "accelerate")}
    (OUT / "smollm2-golden.json").write_text(json.dumps({
        "model": f"shared/models/{GGUF_NAME}",
        "messages": messages,
        "prompt": prompt,
        "prompt_ids": ids,
        "answer_ids": answer,
        "answer": text,
        "eos_token_id": tok.eos_token_id,
        "versions": versions,
    }, indent=2, ensure_ascii=False) + "\n")
    print(f"smollm2: prompt {ids}")
    print(f"smollm2: answer {answer} = {text!r}")


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    OUT.mkdir(parents=True, exist_ok=True)
    tiny_models()
    smollm2()
    for f in sorted(OUT.rglob("*")):
        if f.is_file():
            print(f"{f.relative_to(OUT)}: {f.stat().st_size} bytes")
    print(f"wrote {OUT} (torch {torch.__version__}, transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
