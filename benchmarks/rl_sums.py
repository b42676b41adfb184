"""GRPO on SmolLM2-135M-Instruct for one-digit sums (appendix F), a longer CPU run.

The setup of page F's run (chapters/A6_rl_verifiable_rewards.ipynb, section "The run"):
the 100 sums a + b of two digits 0-9, shuffled once (random.Random(0)) and split into
``--train`` training prompts and the rest held out; the plain prompt ``Question: What
is a + b?`` / ``Answer:`` (no chat template), the reply ending at the first line-break
token; reward 1 when the reply, the line break left out, is one whole number (surrounding
spaces and a final full stop allowed) equal to a + b, else 0. The top ``--top`` blocks of
a copy of the model are trained by :func:`lib.posttrain.grpo` (``--group`` samples for
each of ``--prompts`` prompts per step at ``--temperature``, one update per batch, a k3
penalty ``--beta`` to the frozen starting model), ``--steps`` steps per seed.

Prints, per seed, the steps, the wall time and held-out pass@1 (greedy, strict rule)
before and after, then the book's verdict (lib.stats.compare) over the seeds, and the
load average before and after.

    .venv/bin/python benchmarks/rl_sums.py [--steps 120] [--seeds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lib.model import completions, left_pad  # noqa: E402
from lib.posttrain import grpo  # noqa: E402
from lib.smollm import from_gguf, smollm2_gguf  # noqa: E402
from lib.stats import compare  # noqa: E402


def strict(reply: str) -> int | None:
    "The rule: the reply is one whole number (spaces and a final full stop allowed)."
    found = re.fullmatch(r"\s*(-?\d+)\.?\s*", reply)
    return int(found[1]) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--train", type=int, default=60)
    parser.add_argument("--top", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch {torch.__version__}, "
          f"{args.threads} thread(s)")
    base, tok = from_gguf(smollm2_gguf())
    base.requires_grad_(False)
    newline = tok.encode("\n")[0]
    sums = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(sums)
    train, held = sums[:args.train], sums[args.train:]

    def prompt(a: int, b: int) -> list[int]:
        return tok.encode(f"Question: What is {a} + {b}?\nAnswer:")

    def text(ids: list[int]) -> str:
        return tok.decode([t for t in ids if t != newline])

    @torch.no_grad()
    def pass_at_1(model) -> float:
        ids, mask = left_pad([prompt(a, b) for a, b in held], pad_id=newline)
        out = model.generate(ids, args.max_new, temperature=0.0, stop_id=newline,
                             attention_mask=mask)
        said = [text(r) for r in completions(out, ids.size(1), newline)]
        return sum(strict(r) == a + b for r, (a, b) in zip(said, held)) / len(held)

    def reward(i: int, response: list[int]) -> float:
        a, b = train[i]
        return float(strict(text(response)) == a + b)

    prompts = [prompt(a, b) for a, b in train]
    start = pass_at_1(base)
    before, after = [], []
    for seed in range(args.seeds):
        model = copy.deepcopy(base)
        model.blocks[-args.top:].requires_grad_(True)
        t0 = time.time()
        log = grpo(model, prompts, reward, args.steps, args.lr, newline,
                   group_size=args.group, prompts_per_step=args.prompts,
                   max_new_tokens=args.max_new, temperature=args.temperature,
                   beta=args.beta, ref_model=base, seed=seed)
        wall = time.time() - t0
        before.append(start)
        after.append(pass_at_1(model))
        if args.log_every:
            for k in range(0, args.steps, args.log_every):
                rows = log[k:k + args.log_every]
                print(f"  steps {k:4d}-{k + len(rows) - 1:4d}: reward "
                      f"{sum(r['reward'] for r in rows) / len(rows):.3f}, kl "
                      f"{sum(r['kl'] for r in rows) / len(rows):.4f}, length "
                      f"{sum(r['length'] for r in rows) / len(rows):.2f}")
        print(f"seed {seed}: {args.steps} steps, {wall:.0f} s, held-out pass@1 "
              f"{before[-1]:.3f} -> {after[-1]:.3f} ({len(held)} items)", flush=True)
    if args.seeds >= 3:
        print("after vs before:", compare(after, before))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
