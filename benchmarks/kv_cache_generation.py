"""Generation with and without the KV cache: speed-up and identical outputs.

Generates ``--new-tokens`` tokens (default 512) from a short prompt with ``GPT.generate``, once
with ``use_cache=True`` (each step feeds only the newest token; earlier keys and values come from
the cache) and once with ``use_cache=False`` (each step recomputes the whole sequence). The model is
the tiny character architecture with ``context_length=1024``, so all 512 new tokens fit in the
context and the cache is used for every step (the trained tiny model has a 128-token context, after
which both paths recompute on a sliding window). Weights are a fixed random initialisation: speed
does not depend on them, and identical outputs are checked both for greedy decoding and for seeded
sampling.

    .venv/bin/python benchmarks/kv_cache_generation.py [--new-tokens 512] [--repeats 3] [--threads N]
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
from lib.model import GPT, GPTConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path (alternating)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = GPTConfig.tiny(vocab_size=65, context_length=1024)
    if args.prompt_tokens + args.new_tokens > config.context_length:
        raise SystemExit(f"--prompt-tokens + --new-tokens must be <= {config.context_length}")
    model = GPT(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens))

    def generate(use_cache: bool, temperature: float) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1234)
        return model.generate(prompt, args.new_tokens, temperature=temperature, use_cache=use_cache,
                              generator=generator)

    # Identical outputs, greedy and sampled.
    for temperature, name in ((0.0, "greedy"), (1.0, "sampled (T=1, seeded)")):
        cached, full = generate(True, temperature), generate(False, temperature)
        same = torch.equal(cached, full)
        print(f"{name}: {args.new_tokens} new tokens identical with and without cache: {same}")
        if not same:
            first = int((cached != full).nonzero()[0, 1])
            raise SystemExit(f"outputs differ first at position {first}")

    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for use_cache in (True, False):
            start, start_cpu = time.perf_counter(), time.process_time()
            generate(use_cache, 1.0)
            times[use_cache].append(time.perf_counter() - start)
            cpu[use_cache].append(time.process_time() - start_cpu)

    with_cache, without = statistics.median(times[True]), statistics.median(times[False])
    cpu_with, cpu_without = statistics.median(cpu[True]), statistics.median(cpu[False])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_name()}")
    print(f"GPTConfig.tiny(context_length=1024): {model.num_parameters():,} parameters, batch 1, "
          f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, median of {args.repeats}")
    print(f"with cache:    {with_cache:.2f} s ({args.new_tokens / with_cache:,.0f} tokens/s)")
    print(f"without cache: {without:.2f} s ({args.new_tokens / without:,.0f} tokens/s)")
    print(f"speed-up: {without / with_cache:.1f}x wall clock, {cpu_without / cpu_with:.1f}x process CPU time "
          f"({cpu_with:.2f} s vs {cpu_without:.2f} s)")


if __name__ == "__main__":
    main()
