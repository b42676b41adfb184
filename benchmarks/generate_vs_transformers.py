"""Greedy generation with SmolLM2-135M-Instruct: the book's GPT against transformers.

Both models are loaded from the same GGUF file (``lib.smollm.smollm2_gguf()``), in
float32 on the CPU, and generate ``--new-tokens`` tokens greedily from the same chat
prompt, with a KV cache. transformers is told to ignore ``<|im_end|>`` so that both
produce exactly the same number of tokens; the tokens are checked to be identical. Runs
alternate between the two models and the median of ``--repeats`` timed runs is reported.

    .venv/bin/python benchmarks/generate_vs_transformers.py [--new-tokens 64] [--repeats
    3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.train_throughput import cpu_name  # noqa: E402
from lib.smollm import from_gguf, smollm2_gguf  # noqa: E402

QUESTION = "What is the capital of France? Answer in one long paragraph."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    ours, tokenizer = from_gguf(path)
    theirs = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    # No stop token: both models generate exactly n tokens, <|im_end|> or not.
    theirs.generation_config.eos_token_id = None
    theirs.generation_config.pad_token_id = tokenizer.eos_id
    prompt = torch.tensor(
        [tokenizer.encode_chat([{"role": "user", "content": QUESTION}])]
    )
    n = args.new_tokens

    def run_ours() -> torch.Tensor:
        return ours.generate(prompt, n, temperature=0)

    def run_theirs() -> torch.Tensor:
        with torch.no_grad():
            # An explicit mask: without one, transformers would take every <|im_end|> in
            # the prompt for padding (pad token 2 is no longer the stop token).
            return theirs.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=n, do_sample=False)

    a, b = run_ours(), run_theirs()
    same = torch.equal(a, b)
    print(f"{n} greedy tokens identical: {same}")
    if not same:
        first = int((a != b).nonzero()[0, 1]) - prompt.shape[1]
        print(f"  first difference at new token {first}")
    times: dict[str, list[float]] = {"book": [], "transformers": []}
    for _ in range(args.repeats):
        for name, run in (("book", run_ours), ("transformers", run_theirs)):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    book, hf = statistics.median(times["book"]), statistics.median(
        times["transformers"]
    )
    print(
        f"CPU: {cpu_name()}, torch threads: {torch.get_num_threads()}, prompt "
        f"{prompt.shape[1]} tokens, {n} new tokens, median of {args.repeats}"
    )
    print(f"book GPT:     {book:.2f} s ({n / book:.1f} tokens/s)  runs {times['book']}")
    print(
        f"transformers: {hf:.2f} s ({n / hf:.1f} tokens/s)  "
        f"runs {times['transformers']}"
    )
    print(f"book / transformers time: {book / hf:.2f}")


if __name__ == "__main__":
    main()
