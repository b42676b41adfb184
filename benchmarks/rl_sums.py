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

Evaluation is greedy with its own cap, ``--eval-new`` new tokens (12, page E's cap for
this prompt), so that replies in equation form ("9 + 0 = 9") are read whole; sampling
keeps ``--max-new``. Prints, per seed, the steps, the wall time, held-out greedy pass@1
(strict rule) before and after, McNemar's exact test of after against before on the
held-out items (lib.evaluation.mcnemar_exact) and the seed's strict gains split into
items whose starting reply already held the right sum in another form (its last number,
the lenient rule) and the others (a wrong number or none); then the book's
verdict (lib.stats.compare) over the seeds, an exact sign test over the items whose
correctness averaged over the seeds moved, and the load average before and after.

    .venv/bin/python benchmarks/rl_sums.py [--steps 120] [--seeds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lib.model import completions, left_pad  # noqa: E402
from lib.posttrain import grpo  # noqa: E402
from lib.smollm import from_gguf, smollm2_gguf  # noqa: E402
from lib.evaluation import last_number, mcnemar_exact, strict_number  # noqa: E402
from lib.stats import compare  # noqa: E402


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
    parser.add_argument("--eval-new", type=int, default=12)
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
    def greedy(model) -> tuple[list[bool], list[bool]]:
        "Per held-out item: right by the strict rule, right by the lenient rule."
        ids, mask = left_pad([prompt(a, b) for a, b in held], pad_id=newline)
        out = model.generate(ids, args.eval_new, temperature=0.0, stop_id=newline,
                             attention_mask=mask)
        said = [text(r) for r in completions(out, ids.size(1), newline)]
        return ([strict_number(r) == a + b for r, (a, b) in zip(said, held)],
                [last_number(r) == a + b for r, (a, b) in zip(said, held)])

    def reward(i: int, response: list[int]) -> float:
        a, b = train[i]
        return float(strict_number(text(response)) == a + b)

    prompts = [prompt(a, b) for a, b in train]
    start = greedy(base)
    rate = sum(start[0]) / len(held)
    before, after, items = [], [], []
    for seed in range(args.seeds):
        model = copy.deepcopy(base)
        model.blocks[-args.top:].requires_grad_(True)
        t0 = time.time()
        log = grpo(model, prompts, reward, args.steps, args.lr, newline,
                   group_size=args.group, prompts_per_step=args.prompts,
                   max_new_tokens=args.max_new, temperature=args.temperature,
                   beta=args.beta, ref_model=base, seed=seed)
        wall = time.time() - t0
        right, _ = greedy(model)
        items.append(right)
        before.append(rate)
        after.append(sum(right) / len(held))
        if args.log_every:
            for k in range(0, args.steps, args.log_every):
                rows = log[k:k + args.log_every]
                print(f"  steps {k:4d}-{k + len(rows) - 1:4d}: reward "
                      f"{sum(r['reward'] for r in rows) / len(rows):.3f}, kl "
                      f"{sum(r['kl'] for r in rows) / len(rows):.4f}, length "
                      f"{sum(r['length'] for r in rows) / len(rows):.2f}")
        print(f"seed {seed}: {args.steps} steps, {wall:.0f} s, held-out pass@1 "
              f"{before[-1]:.3f} -> {after[-1]:.3f} ({len(held)} items)", flush=True)
        only_before, only_after, p = mcnemar_exact(start[0], right)
        gained = [i for i in range(len(held)) if right[i] and not start[0][i]]
        form = sum(start[1][i] for i in gained)
        print(f"  items right only after {only_after}, only before {only_before}, "
              f"McNemar p = {p:.2g}; of the gains, right sum before in another form "
              f"{form}, not the right sum before {len(gained) - form}", flush=True)
    if args.seeds >= 3:
        print("after vs before, over seeds:", compare(after, before))
    change = [sum(r[i] for r in items) / len(items) - start[0][i]
              for i in range(len(held))]
    down, up, p = mcnemar_exact([c < 0 for c in change], [c > 0 for c in change])
    print(f"items, mean over seeds: {up} up, {down} down, sign test p = {p:.2g}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
