"""Golden token ids for ringtmp's GGUF tokenizer: what `transformers` (its GGUF integration,
with `gguf` and `torch` installed) makes of the shared SmolLM2 file's embedded tokenizer, on a
multilingual text with special tokens, digits, code and emoji, and the chat template rendered
with the generation prompt. Writes `gguf/smollm2-tokens.json`.

    pip install transformers gguf torch
    python3 benches/reference/gguf_tokenizer_golden.py ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import json
import pathlib
import sys

import transformers
from transformers import AutoTokenizer

TEXTS = [
    "<|im_start|>user\nHéllo, wörld! a12345 and 678 — 世界 こんにちは 🙂 Привет\n"
    "\tcode: fn main() { let x = 3.14; }<|im_end|>\n",
    "  leading spaces,   runs of   spaces\n\n\nand newlines<|endoftext|>",
    "Ünïcödé ñ ß Œ ǅ — ‘quotes’ “double” … 🤖🚀 العربية हिन्दी 한국어",
]


def main():
    path = pathlib.Path(sys.argv[1])
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cases = []
    for text in TEXTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids)})
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = pathlib.Path(__file__).parent / "gguf" / "smollm2-tokens.json"
    out.write_text(json.dumps({
        "transformers": transformers.__version__,
        "cases": cases,
        "chat": {"messages": messages, "rendered": chat},
    }, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
