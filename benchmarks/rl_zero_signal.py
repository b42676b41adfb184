"""How often a GRPO group of page F's task carries no signal, against the sampling
temperature (appendix F, pitfalls): the starting SmolLM2-135M-Instruct, no training.

For each of the 60 training prompts of page F's run (the 100 sums a + b of two digits,
shuffled once with random.Random(0), the first 60; the plain ``Question: What is a + b?`` /
``Answer:`` prompt), :func:`lib.posttrain.rollout` samples a group of ``--group`` replies
(at most ``--max-new`` tokens, ending at the line break) at each temperature; a reply's
reward is 1 when it is one whole number equal to a + b (lib.evaluation.strict_number),
else 0. A group is zero-signal when its rewards are all equal (every advantage 0). Prints,
per temperature and seed, the share of zero-signal groups and the mean reward; then the
book's verdict (lib.stats.compare, paired by seed) of each temperature against the next.

    .venv/bin/python benchmarks/rl_zero_signal.py [--temperatures 0.3,0.7,1.0] [--seeds 5]
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
from lib.evaluation import strict_number  # noqa: E402
from lib.posttrain import rollout  # noqa: E402
from lib.smollm import from_gguf, smollm2_gguf  # noqa: E402
from lib.stats import compare  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--temperatures", default="0.3,0.7,1.0")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch {torch.__version__}")
    base, tok = from_gguf(smollm2_gguf())
    newline = tok.encode("\n")[0]
    sums = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(sums)
    train = sums[:60]
    prompts = [tok.encode(f"Question: What is {a} + {b}?\nAnswer:") for a, b in train]
    G = args.group
    shares = {}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        shares[temperature] = []
        for seed in range(args.seeds):
            t0 = time.time()
            gen = torch.Generator().manual_seed(seed)
            _, replies = rollout(base, prompts, G, args.max_new, newline, temperature, gen)
            text = [tok.decode([t for t in r if t != newline]) for r in replies]
            r = torch.tensor([float(strict_number(x) == a + b) for x, (a, b)
                              in zip(text, [s for s in train for _ in range(G)])])
            groups = r.view(-1, G)
            zero = (groups == groups[:, :1]).all(1).double().mean().item()
            shares[temperature].append(zero)
            print(f"T {temperature}: seed {seed} zero-signal share {zero:.3f}, mean reward "
                  f"{r.mean():.3f} ({time.time() - t0:.0f} s)", flush=True)
    temps = list(shares)
    for low, high in zip(temps, temps[1:]):
        print(f"zero-signal share, T {low} against T {high}: "
              f"{compare(shares[low], shares[high])}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
