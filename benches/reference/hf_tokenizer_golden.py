"""A tokenizer for `hf-tiny/` as `transformers` saves one (`tokenizer.json`,
`tokenizer_config.json` with special tokens as AddedToken objects and a chat template,
`generation_config.json`), trained here as a small byte-level BPE with the `tokenizers`
package, and the ids `transformers` gives on a multilingual text with special tokens
(`hf-tiny/tokens.json`).

    pip install transformers tokenizers
    python3 benches/reference/hf_tokenizer_golden.py
"""

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

OUT = pathlib.Path(__file__).parent / "hf-tiny"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "Le renard brun rapide saute par-dessus le chien paresseux. ",
    "Der schnelle braune Fuchs springt über den faulen Hund. ",
    "1234567890 3.14 fn main() { let x = 42; } <b>tag</b> & more",
    "世界 こんにちは Привет мир",
]
TEXTS = [
    "<s><|user|>\nThe quick fox — über Привет 世界 3.14159!</s>\n",
    "  spaces   and\n\nnewlines\t<unk> unknown ☃",
]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>"])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(OUT))
    (OUT / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.token_to_id("<s>"), "eos_token_id": [tok.token_to_id("</s>"), tok.token_to_id("<|user|>")]},
        indent=2) + "\n")
    loaded = AutoTokenizer.from_pretrained(str(OUT))
    cases = [{"text": t, "ids": loaded(t)["input_ids"]} for t in TEXTS]
    messages = [{"role": "user", "content": "  Hello there  "}]
    rendered = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (OUT / "tokens.json").write_text(json.dumps(
        {"cases": cases, "chat": {"messages": messages, "rendered": rendered}}, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
