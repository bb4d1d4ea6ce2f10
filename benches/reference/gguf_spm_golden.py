"""Golden file for ringtmp's SentencePiece GGUF tokenizers (`tokenizer.ggml.model = "llama"`, as
Llama 2, TinyLlama, Mistral v0.1 and many GGUF files of the Llama family hold them).

Trains a small SentencePiece BPE model with byte fallback on a multilingual text, writes it as
llama.cpp's converter writes one (`convert_hf_to_gguf.py`'s `_create_vocab_sentencepiece`: each
piece, its score and its type — normal, unknown, control, user-defined, unused, byte — no merges;
BOS, EOS, UNK, `add_space_prefix`, `add_bos_token`) into `gguf/spm-tokenizer.gguf` (a tokenizer
and the `llama.*` keys that name the architecture, no tensors), and records what `transformers`
(its GGUF integration) makes of that file: the ids of texts with special tokens, digits, emoji and
characters the vocabulary lacks (byte fallback), and their decoding, in `gguf/spm-tokens.json`.

    pip install sentencepiece gguf transformers torch
    python3 benches/reference/gguf_spm_golden.py
"""

import io
import json
import pathlib

import gguf
import sentencepiece as spm
import transformers
from transformers import AutoTokenizer

HERE = pathlib.Path(__file__).parent / "gguf"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Le renard brun rapide saute par-dessus le chien paresseux. ",
    "Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus Köln! ",
    "Быстрая коричневая лиса прыгает через ленивую собаку. ",
    "敏捷的棕色狐狸跳过了懒狗。 素早い茶色の狐がのろまな犬を飛び越える。 ",
    "Numbers 12345 and 67890, code: fn main() { let x = 3.14; } ",
    "Questions? Answers! (parentheses) [brackets] {braces} — dashes… ",
]
TEXTS = [
    "Hello world! The quick fox — Grüße, 東京 12345 🙂",
    "<|im_start|>user\nWhat is <think> the answer?<|im_end|>\n",
    "  leading spaces,   runs of   spaces\n\n\nand newlines",
    "Ünïcödé ñ ß Œ — ‘quotes’ “double” … 🤖 العربية हिन्दी 한국어",
]


def train():
    lines = [line for text in CORPUS for line in [text] * 20]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        character_coverage=1.0,
        control_symbols=["<|im_start|>", "<|im_end|>"],
        user_defined_symbols=["<think>"],
        add_dummy_prefix=True,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_gguf(sp, path):
    tokens, scores, types = [], [], []
    T = gguf.TokenType
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i).encode("utf-8"))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            kind = T.UNKNOWN
        elif sp.is_control(i):
            kind = T.CONTROL
        elif sp.is_unused(i):
            kind = T.UNUSED
        elif sp.is_byte(i):
            kind = T.BYTE
        elif sp.id_to_piece(i) == "<think>":
            kind = T.USER_DEFINED
        else:
            kind = T.NORMAL
        types.append(kind)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_space_prefix(True)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    HERE.mkdir(parents=True, exist_ok=True)
    sp = train()
    path = HERE / "spm-tokenizer.gguf"
    write_gguf(sp, path)
    tok = AutoTokenizer.from_pretrained(str(HERE), gguf_file=path.name)
    cases = []
    for text in TEXTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids)})
    out = HERE / "spm-tokens.json"
    out.write_text(json.dumps({
        "transformers": transformers.__version__,
        "sentencepiece": spm.__version__,
        "vocab_size": sp.vocab_size(),
        "cases": cases,
    }, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {path} and {out}")


if __name__ == "__main__":
    main()
