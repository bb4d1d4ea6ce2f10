"""Golden files for ringtmp's GGUF model reader: the tiny models of `pretrained/` written as GGUF
files by the `gguf` package, their matrices in every quantisation type ringtmp reads, and the
logits `transformers` gives for the values those blocks hold.

For each of `llama-gqa` (grouped-query attention, Llama 3 RoPE scaling as llama.cpp's
`rope_freqs` table), `llama-tied` (multi-query, linear RoPE scaling, tied head), `qwen2` (q/k/v
biases), `qwen3` (q/k norms, head size 32 ≠ width/heads) and `gpt2` (fused q/k/v, learned
positions, LayerNorm), `gguf/models/NAME.gguf` holds the model under llama.cpp's names and
conventions (`convert_hf_to_gguf.py`: a Llama's q and k rows interleaved per head, GPT-2's
Conv1D weights transposed and its head written beside the table it is tied to), the matrices in
the legacy types F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 in turn (quantised by
`gguf.quants.quantize`), the token table in Q8_0, norms and biases in F32. `kquants.gguf` is a
Llama of width 256 (the K-quants' blocks are 256 wide) whose matrices are random Q4_K, Q5_K and
Q6_K blocks with finite scales (the package cannot quantise to them).

`gguf/models/NAME.golden.safetensors` holds `input_ids` (f32 values of ids, [2, 12]) and
`logits` ([2, 12, 160]): the Hugging Face model of the same config whose every tensor is set
to what the file's blocks dequantise to (`gguf.quants.dequantize`, the interleaving undone), run
by `transformers` in f32.

    pip install torch transformers gguf safetensors numpy
    python3 benches/reference/gguf_models_golden.py
"""

import math
import pathlib

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

HERE = pathlib.Path(__file__).parent
OUT = HERE / "gguf" / "models"
LEGACY = [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
KQUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
rng = np.random.default_rng(20261207)


def interleave(w, heads):
    """llama.cpp's `permute`: each head's rows (first halves, then second halves) interleaved."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def deinterleave(w, heads):
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant(t, rows, cols):
    """Random blocks of K-quant `t` whose scales give weights of about 0.05."""
    block, size = gguf.GGML_QUANT_SIZES[t]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    f16 = lambda k, spread: (np.abs(rng.standard_normal(k)) * spread).astype(np.float16).view(np.uint8)
    if t in (T.Q4_K, T.Q5_K):
        spread = 2e-4 if t == T.Q4_K else 1e-4
        raw[:, 0:2] = f16(n, spread).reshape(n, 2)
        raw[:, 2:4] = f16(n, spread * 4).reshape(n, 2)
    else:  # Q6_K: d last
        raw[:, size - 2 : size] = f16(n, 5e-5).reshape(n, 2)
    return raw.reshape(rows, -1)


class Writer:
    """Tensors into a GGUF file, and what their blocks dequantise to."""

    def __init__(self, path, arch):
        self.w = gguf.GGUFWriter(str(path), arch=arch)
        self.values = {}

    def add(self, name, values, kind):
        values = np.ascontiguousarray(values, dtype=np.float32)
        if kind == T.F32:
            data = values
        else:
            data = quants.quantize(values, kind)
        self.w.add_tensor(name, data, raw_dtype=kind)
        self.values[name] = values if kind == T.F32 else quants.dequantize(data, kind).reshape(values.shape)
        return self.values[name]

    def add_raw(self, name, raw, kind, shape):
        self.w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
        self.values[name] = quants.dequantize(raw, kind).reshape(shape)
        return self.values[name]

    def close(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def llama3_factors(config):
    rope = config.rope_parameters
    base = rope["rope_theta"]
    dim = config.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def llama_like(name, model, config, out, kinds, raw_kinds=False):
    """A Llama, Qwen2 or Qwen3 model: writes its file, returns {hf name: dequantised values}."""
    arch = config.model_type
    w = Writer(out, arch)
    g = w.w
    g.add_context_length(config.max_position_embeddings)
    g.add_embedding_length(config.hidden_size)
    g.add_block_count(config.num_hidden_layers)
    g.add_feed_forward_length(config.intermediate_size)
    g.add_head_count(config.num_attention_heads)
    g.add_head_count_kv(config.num_key_value_heads)
    g.add_layer_norm_rms_eps(config.rms_norm_eps)
    g.add_rope_freq_base(config.rope_parameters["rope_theta"])
    g.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    g.add_key_length(head_dim)
    g.add_value_length(head_dim)
    g.add_rope_dimension_count(head_dim)
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "linear":
        g.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        g.add_rope_scaling_factor(config.rope_parameters["factor"])
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    values = {}
    kind = iter(kinds * 8)
    permute = arch == "llama"
    values["model.embed_tokens.weight"] = w.add("token_embd.weight", sd["model.embed_tokens.weight"], T.Q8_0)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        values[p + "input_layernorm.weight"] = w.add(b + "attn_norm.weight", sd[p + "input_layernorm.weight"], T.F32)
        values[p + "post_attention_layernorm.weight"] = w.add(
            b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], T.F32
        )
        for hf, ours, heads in [
            ("self_attn.q_proj", "attn_q", config.num_attention_heads),
            ("self_attn.k_proj", "attn_k", config.num_key_value_heads),
            ("self_attn.v_proj", "attn_v", None),
            ("self_attn.o_proj", "attn_output", None),
            ("mlp.gate_proj", "ffn_gate", None),
            ("mlp.up_proj", "ffn_up", None),
            ("mlp.down_proj", "ffn_down", None),
        ]:
            weight = sd[p + hf + ".weight"]
            t = next(kind)
            if raw_kinds:
                stored = w.add_raw(b + ours + ".weight", random_kquant(t, *weight.shape), t, weight.shape)
            else:
                stored = w.add(b + ours + ".weight", interleave(weight, heads) if permute and heads else weight, t)
            values[p + hf + ".weight"] = deinterleave(stored, heads) if permute and heads else stored
            if p + hf + ".bias" in sd:
                bias = sd[p + hf + ".bias"]
                stored = w.add(b + ours + ".bias", interleave(bias, heads) if permute and heads else bias, T.F32)
                values[p + hf + ".bias"] = deinterleave(stored, heads) if permute and heads else stored
        for hf, ours in [("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")]:
            if p + hf + ".weight" in sd:
                values[p + hf + ".weight"] = w.add(b + ours + ".weight", sd[p + hf + ".weight"], T.F32)
    values["model.norm.weight"] = w.add("output_norm.weight", sd["model.norm.weight"], T.F32)
    if not config.tie_word_embeddings:
        head = sd["lm_head.weight"]
        if raw_kinds:
            values["lm_head.weight"] = w.add_raw("output.weight", random_kquant(T.Q6_K, *head.shape), T.Q6_K, head.shape)
        else:
            values["lm_head.weight"] = w.add("output.weight", head, T.Q8_0)
    if rope_type == "llama3":
        w.add("rope_freqs.weight", llama3_factors(config), T.F32)
    w.close()
    return values


def gpt2(model, config, out, kinds):
    w = Writer(out, "gpt2")
    g = w.w
    g.add_context_length(config.n_positions)
    g.add_embedding_length(config.n_embd)
    g.add_block_count(config.n_layer)
    g.add_feed_forward_length(4 * config.n_embd)
    g.add_head_count(config.n_head)
    g.add_layer_norm_eps(config.layer_norm_epsilon)
    g.add_vocab_size(config.vocab_size)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    values = {}
    kind = iter(kinds * 8)
    table = w.add("token_embd.weight", sd["transformer.wte.weight"], T.Q8_0)
    values["transformer.wte.weight"] = table
    values["transformer.wpe.weight"] = w.add("position_embd.weight", sd["transformer.wpe.weight"], T.F32)
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        b = f"blk.{i}."
        for hf, ours in [("ln_1", "attn_norm"), ("ln_2", "ffn_norm")]:
            for part in ["weight", "bias"]:
                values[p + hf + "." + part] = w.add(b + ours + "." + part, sd[p + hf + "." + part], T.F32)
        for hf, ours in [("attn.c_attn", "attn_qkv"), ("attn.c_proj", "attn_output"), ("mlp.c_fc", "ffn_up"),
                         ("mlp.c_proj", "ffn_down")]:
            stored = w.add(b + ours + ".weight", sd[p + hf + ".weight"].T, next(kind))
            values[p + hf + ".weight"] = stored.T
            values[p + hf + ".bias"] = w.add(b + ours + ".bias", sd[p + hf + ".bias"], T.F32)
    for part in ["weight", "bias"]:
        values["transformer.ln_f." + part] = w.add("output_norm." + part, sd["transformer.ln_f." + part], T.F32)
    # llama.cpp's converter writes the tied head beside the table, in the table's type.
    w.add("output.weight", sd["transformer.wte.weight"], T.Q8_0)
    w.close()
    return values


def logits_of(model, values, ids):
    if model.config.tie_word_embeddings:  # the head is the table: never its old values
        table = "transformer.wte.weight" if model.config.model_type == "gpt2" else "model.embed_tokens.weight"
        values = dict(values, **{"lm_head.weight": values[table]})
    state = model.state_dict()
    for name, v in values.items():
        state[name] = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
    model.load_state_dict(state)
    model.tie_weights()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float()


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    ids = load_file(str(HERE / "pretrained" / "llama-gqa" / "golden.safetensors"))["input_ids"].numpy().astype(np.int64)
    for n, name in enumerate(["llama-gqa", "llama-tied", "qwen2", "qwen3", "gpt2"]):
        model = AutoModelForCausalLM.from_pretrained(HERE / "pretrained" / name, dtype=torch.float32).eval()
        config = model.config
        kinds = LEGACY[n:] + LEGACY[:n]
        path = OUT / f"{name}.gguf"
        if config.model_type == "gpt2":
            values = gpt2(model, config, path, kinds)
        else:
            values = llama_like(name, model, config, path, kinds)
        logits = logits_of(model, values, ids)
        save_file({"input_ids": torch.from_numpy(ids).float(), "logits": logits}, str(OUT / f"{name}.golden.safetensors"))
        print(f"{path}: {path.stat().st_size} bytes")
    config = LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=160, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = OUT / "kquants.gguf"
    values = llama_like("kquants", model, config, path, KQUANTS, raw_kinds=True)
    logits = logits_of(model, values, ids)
    save_file({"input_ids": torch.from_numpy(ids).float(), "logits": logits}, str(OUT / "kquants.golden.safetensors"))
    print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
