"""Benchmark: training byte-level BPE on TinyShakespeare, fast (incremental) vs naive (recount) trainer.

Both trainers work on the same distinct pre-split chunks with their counts. The naive one recounts
every pair of every chunk after each merge; the fast one (lib.tokenizers.learn_merges) updates the
pair counts only in the chunks where the merged pair occurred. The script checks that both learn the
identical merges and prints times and their ratio.

Usage: python benchmarks/bpe_train.py [--vocab-size 512] [--repeats 3]
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib.data import load_text  # noqa: E402
from lib.tokenizers import BPETokenizer, chunk_counts, learn_merges, learn_merges_naive  # noqa: E402


def best_time(fn, repeats: int) -> tuple[float, object]:
    """Smallest wall-clock time over ``repeats`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the fast trainer (best is kept)")
    args = parser.parse_args()
    n_merges = args.vocab_size - 256

    text = load_text()
    split_s, counts = best_time(lambda: chunk_counts(text), args.repeats)
    print(f"python {platform.python_version()} on {platform.machine()}, {len(text):,} characters, "
          f"{sum(counts.values()):,} chunks, {len(counts):,} distinct; pre-split {split_s:.3f} s")

    fast_s, fast = best_time(lambda: learn_merges(counts, n_merges), args.repeats)
    naive_s, naive = best_time(lambda: learn_merges_naive(counts, n_merges), 1)
    train_s, tok = best_time(lambda: BPETokenizer.train(text, args.vocab_size), args.repeats)

    identical = fast.merges == naive.merges and fast.n_tokens == naive.n_tokens
    print(f"merges learned: {len(fast.merges)} (vocab {args.vocab_size}); identical merges: {identical}")
    print(f"naive recount trainer : {naive_s:8.3f} s")
    print(f"fast incremental      : {fast_s:8.3f} s  (best of {args.repeats})")
    print(f"speed-up (naive/fast) : {naive_s / fast_s:8.1f}x")
    print(f"BPETokenizer.train end to end (pre-split + fast merges): {train_s:.3f} s; "
          f"tokens per character {fast.n_tokens[-1] / len(text):.4f}")
    if not identical or list(tok.merges) != fast.merges:
        sys.exit("the two trainers disagree")


if __name__ == "__main__":
    main()
