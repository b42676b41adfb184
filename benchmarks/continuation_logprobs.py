"""Multiple-choice scoring throughput: lib.evaluation.continuation_logprobs batched against
one option at a time.

Builds ``--items`` cloze items from the held-out tenth of TinyShakespeare (two lines of
context, four candidate lines; an option is about 12 SmolLM2 tokens after a context of about
23), and scores every option
with SmolLM2-135M-Instruct (from its GGUF file) and with the tiny character model: once in
one call (``batch_size=--batch``, padded batches, longest first) and once with one call per
option (``batch_size=1``). Prints options per second for both and the speed-up, checks that
both give the same scores, and prints the load average before and after.

    .venv/bin/python benchmarks/continuation_logprobs.py [--items 16] [--batch 16] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.train_throughput import cpu_name  # noqa: E402
from lib import data  # noqa: E402
from lib.evaluation import continuation_logprobs  # noqa: E402
from lib.smollm import from_gguf, smollm2_gguf  # noqa: E402
from lib.tiny_model import tiny_shakespeare_model  # noqa: E402


def cloze_pairs(n_items: int) -> tuple[list[str], list[str]]:
    """(contexts, options): four options per item, each option with its item's context."""
    text = data.load_text()
    lines = text[int(len(text) * 0.9):].split("\n")
    pool = [x for x in lines if len(x) >= 20 and not x.endswith(":")]
    rng = random.Random(0)
    starts = [i for i in range(2, len(lines)) if lines[i] in pool and lines[i - 1] and lines[i - 2]]
    contexts, options = [], []
    for i in rng.sample(starts, n_items):
        for option in [lines[i]] + rng.sample(pool, 3):
            contexts.append(lines[i - 2] + "\n" + lines[i - 1] + "\n")
            options.append(option)
    return contexts, options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts, options = cloze_pairs(args.items)
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    for name, (model, tok) in [("tiny", tiny_shakespeare_model()),
                               ("SmolLM2", from_gguf(smollm2_gguf()))]:
        continuation_logprobs(model, tok, contexts[:4], options[:4])  # warm-up
        start = time.perf_counter()
        batched, counts = continuation_logprobs(model, tok, contexts, options,
                                                batch_size=args.batch)
        t_batched = time.perf_counter() - start
        start = time.perf_counter()
        single = torch.cat([continuation_logprobs(model, tok, c, [o], batch_size=1)[0]
                            for c, o in zip(contexts, options)])
        t_single = time.perf_counter() - start
        assert torch.allclose(batched, single, atol=1e-3), (batched - single).abs().max()
        n = len(options)
        print(f"{name:8s} {n} options, {counts.sum().item()} option tokens: batched "
              f"{n / t_batched:8.1f} options/s, one at a time {n / t_single:8.1f} options/s, "
              f"speed-up {t_single / t_batched:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
