"""llama.cpp's decode speed on the same GGUF file, prompt and threads as
`pretrained_generate_speed.py` (through `llama-cpp-python`): greedy, the prompt's ids given as
ids, time to the first token (the prompt's evaluation) and tokens/s after it, best of 3.

    pip install llama-cpp-python   # builds llama.cpp from source for this CPU
    python3 benches/reference/llama_cpp_generate_speed.py MODEL.gguf 2 128 1,9690,198,...
"""

import sys
import time

from llama_cpp import Llama


def main():
    path, threads, tokens, ids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ids = [int(i) for i in ids.split(",")]
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512,
                verbose=False)
    best = None
    for _ in range(3):
        llm.reset()
        start = time.perf_counter()
        first = None
        count = 0
        for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            count += 1
            if first is None:
                first = time.perf_counter()
            if count == tokens:
                break
        end = time.perf_counter()
        rate = (count - 1) / (end - first)
        if best is None or rate > best[1]:
            best = (first - start, rate)
    print(f"llama.cpp {threads} thread(s): {len(ids)} prompt tokens, first token after "
          f"{best[0]:.3f} s, then {best[1]:.1f} tokens/s (best of 3)")


if __name__ == "__main__":
    main()
