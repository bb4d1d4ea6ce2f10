"""transformers' generation speed on the shared SmolLM2 file, to set beside ringtmp's
(`ringtmp generate --pretrained FILE --prompt-ids IDS --tokens N --temperature 0`): the same
prompt ids, f32 weights (transformers dequantises the GGUF file), greedy, N new tokens forced
(no early end), on the given number of threads. Prints the prompt's encoding time (prefill, to
the first token) and the decoding rate after it.

    pip install torch transformers gguf accelerate
    python3 benches/reference/pretrained_generate_speed.py [THREADS] [TOKENS]
"""

import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF = os.path.join(os.path.dirname(__file__), "../../../shared/models")
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(GGUF, gguf_file=NAME)
    model = AutoModelForCausalLM.from_pretrained(GGUF, gguf_file=NAME, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    x = torch.tensor([ids])
    print("prompt ids:", ",".join(map(str, ids)))
    with torch.no_grad():
        model.generate(x, do_sample=False, max_new_tokens=8, min_new_tokens=8)  # warm-up
        best_prefill, best_rate = float("inf"), 0.0
        for _ in range(3):
            start = time.perf_counter()
            model.generate(x, do_sample=False, max_new_tokens=1, min_new_tokens=1)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(x, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
            total = time.perf_counter() - start
            best_prefill = min(best_prefill, prefill)
            best_rate = max(best_rate, (tokens - 1) / (total - prefill))
    print(f"transformers {threads} thread(s): {len(ids)} prompt tokens, first token after "
          f"{best_prefill:.3f} s, then {best_rate:.1f} tokens/s (best of 3)")


if __name__ == "__main__":
    main()
