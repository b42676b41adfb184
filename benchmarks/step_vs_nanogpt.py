"""Training-step throughput: nanoGPT's step against the book's, on the same shape.

    .venv/bin/python benchmarks/step_vs_nanogpt.py NANOGPT_DIR [--rounds 5] [--steps 50] [--threads 2]

NANOGPT_DIR is a checkout of karpathy/nanoGPT outside this repository; its ``model.py`` is imported
from there at run time (nothing of it is copied into the project). Shape, for every contender:
4 layers, 4 heads, width 128, feed-forward 512, no biases, 65 characters, batch 12 x 64 tokens.

Contenders, each timed over whole optimisation steps on batches drawn from the same in-memory
TinyShakespeare ids:

* ``nanogpt``: nanoGPT's ``GPT`` and ``configure_optimizers`` (AdamW, its CPU settings), and the
  body of its ``train.py`` loop: set the learning rate, forward, backward, clip the gradient norm at
  1, optimizer step, zero the gradients, ``loss.item()`` (its ``--log_interval=1``). Its ``get_batch``
  re-opens a memory map every step; here it samples from memory instead, like the book, which only
  helps nanoGPT.
* ``book-tiny``: ``lib.training.train`` on ``GPTConfig.tiny`` (learned positions, LayerNorm, GELU)
  as the library builds it, without the CPU speed-ups (foreach AdamW, torch's fused attention).
* ``book-cpu-profile``: ``lib.training.train`` on the architecture and training settings of
  ``lib.profiles.cpu_profile``, with what that profile turns on: ``lib.cpu_kernels``' attention
  (``GPTConfig.cpu_kernels``) and fused AdamW (``TrainConfig.fused_adamw``).

The book's steps are timed through ``train`` itself: each round is one call of ``--steps`` steps,
which also builds its optimizer and evaluates one batch at its start and end (a handicap, included,
that shrinks as ``--steps`` grows: worth about two forward passes per call, which at the old default
of 10 steps per round weighed on the book's figure five times more than at 50). Contenders run in
alternating rounds so load from other jobs hits all alike; the script prints the median tokens/s by
wall clock and by process CPU time, and the ratio to nanoGPT.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lib import data  # noqa: E402
from lib.model import GPT, GPTConfig  # noqa: E402
from lib.profiles import cpu_profile  # noqa: E402
from lib.tokenizers import CharTokenizer  # noqa: E402
from lib.training import TrainConfig, train  # noqa: E402

SHAPE = dict(n_layers=4, n_heads=4, d_model=128, d_ff=512)
BATCH, CONTEXT = 12, 64


def load_nanogpt_model(nanogpt_dir: Path):
    """nanoGPT's ``model`` module, imported from the checkout (not copied)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", nanogpt_dir / "model.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no model.py in {nanogpt_dir}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_stepper(module, train_ids: torch.Tensor, vocab_size: int):
    """A function running n of nanoGPT's training steps (its train.py loop body, CPU settings)."""
    torch.manual_seed(1337)
    model = module.GPT(module.GPTConfig(block_size=CONTEXT, vocab_size=vocab_size, n_layer=4, n_head=4,
                                        n_embd=128, dropout=0.0, bias=False))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    generator = torch.Generator().manual_seed(0)
    model.train()

    def steps(n: int) -> None:
        for _ in range(n):
            starts = torch.randint(len(train_ids) - CONTEXT, (BATCH,), generator=generator)
            x = torch.stack([train_ids[i:i + CONTEXT] for i in starts])
            y = torch.stack([train_ids[i + 1:i + 1 + CONTEXT] for i in starts])
            for group in optimizer.param_groups:
                group["lr"] = 1e-3
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()

    return steps


def book_stepper(model_config: GPTConfig, train_config: TrainConfig, train_ids, val_ids):
    """A function running n steps of ``lib.training.train`` on one model (one call per round)."""
    torch.manual_seed(0)
    model = GPT(model_config)

    def steps(n: int) -> None:
        config = dataclasses.replace(train_config, max_steps=n, warmup_steps=0, eval_interval=n,
                                     eval_batches=1)
        train(model, train_ids, None, config, progress=False)

    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("nanogpt_dir", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50, help="optimisation steps per timed round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    text = data.load_text()
    tokenizer = CharTokenizer.from_text(text)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train_ids, val_ids = data.train_val_split(ids, val_fraction=0.1)
    V = tokenizer.vocab_size

    profile = cpu_profile(V)
    base = TrainConfig(batch_size=BATCH, context_length=CONTEXT, lr=1e-3, min_lr=1e-4, seed=0)
    contenders = {
        "nanogpt": nanogpt_stepper(load_nanogpt_model(args.nanogpt_dir), train_ids, V),
        "book-tiny": book_stepper(GPTConfig.tiny(V, context_length=CONTEXT, **SHAPE), base,
                                  train_ids, val_ids),
        "book-cpu-profile": book_stepper(
            dataclasses.replace(profile.model, context_length=CONTEXT, **SHAPE),
            dataclasses.replace(profile.train, batch_size=BATCH, context_length=CONTEXT),
            train_ids, val_ids),
    }
    results = {name: {"wall": [], "cpu": []} for name in contenders}
    for steps in contenders.values():  # warm-up
        steps(2)
    for _ in range(args.rounds):
        for name, steps in contenders.items():
            wall, cpu = time.perf_counter(), time.process_time()
            steps(args.steps)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            results[name]["wall"].append(BATCH * CONTEXT * args.steps / wall)
            results[name]["cpu"].append(BATCH * CONTEXT * args.steps / cpu)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {BATCH} x {CONTEXT}, "
          f"{args.rounds} alternating rounds x {args.steps} steps")
    ref = {clock: statistics.median(results["nanogpt"][clock]) for clock in ("wall", "cpu")}
    for name in contenders:
        wall = statistics.median(results[name]["wall"])
        cpu = statistics.median(results[name]["cpu"])
        print(f"{name:>17}: {wall:8,.0f} tokens/s ({wall / ref['wall']:.2f}x nanoGPT), "
              f"{cpu:8,.0f} tokens per CPU-second ({cpu / ref['cpu']:.2f}x)")
    per_round = [b / n for b, n in zip(results["book-cpu-profile"]["wall"], results["nanogpt"]["wall"])]
    print("book-cpu-profile / nanogpt per round (wall):", " ".join(f"{r:.2f}" for r in per_round))


if __name__ == "__main__":
    main()
