"""Validation loss at equal wall time: nanoGPT's CPU Shakespeare run against the book's CPU profile.

    .venv/bin/python benchmarks/train_vs_nanogpt.py NANOGPT_DIR [--iters 2000 5000] [--threads 2]
        [--seeds 0 1]

NANOGPT_DIR is a checkout of karpathy/nanoGPT outside this repository; it is left untouched. The
script copies it to a temporary folder, puts the book's TinyShakespeare (checksum-verified by
``lib.data``) where nanoGPT's ``data/shakespeare_char/prepare.py`` looks for it, runs that script,
then runs nanoGPT's documented CPU configuration for each iteration count N::

    train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --dropout=0.0 --max_iters=N --lr_decay_iters=N --always_save_checkpoint=True

(``always_save_checkpoint`` only makes it keep its final model, the one scored; its schedule and
data are unchanged) with ``OMP_NUM_THREADS`` set to ``--threads``, timing the whole process.

The book's CPU profile (:func:`lib.profiles.cpu_profile`) then trains for that same wall time:
a short calibration (not counted, after a 10-step warm-up) measures the seconds per
``lib.training.train`` step, and the run
gets as many steps as fit, so its warmup-and-cosine schedule ends when the time does. Both final
models are scored the same way: mean cross-entropy over the whole validation split (the last 10% of
the text, identical for both) cut into windows of 64 characters, nanoGPT's block size.

The last line is ``nanogpt_minus_book: short=<x> long=<y>`` in nats (positive: the book's model is
better); the line before it gives the spread between the book's seeds.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lib import data  # noqa: E402
from lib.profiles import cpu_profile  # noqa: E402
from lib.tokenizers import CharTokenizer  # noqa: E402
from lib.training import train  # noqa: E402

WINDOW = 64
NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                "--n_embd=128", "--dropout=0.0"]


@torch.no_grad()
def score(model: torch.nn.Module, val_ids: torch.Tensor, window: int = WINDOW) -> float:
    """Mean next-character loss over the validation split in consecutive windows of ``window``."""
    model.eval()
    n = (len(val_ids) - 1) // window
    x = val_ids[: n * window].view(n, window)
    y = val_ids[1: n * window + 1].view(n, window)
    total = 0.0
    for i in range(0, n, 256):
        logits, _ = model(x[i:i + 256], y[i:i + 256])
        total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y[i:i + 256].reshape(-1),
                                 reduction="sum").item()
    return total / (n * window)


def prepare_nanogpt(nanogpt_dir: Path, work: Path, text: str) -> Path:
    """A temporary copy of the checkout with nanoGPT's character data prepared from ``text``."""
    copy = work / "nanoGPT"
    shutil.copytree(nanogpt_dir, copy, ignore=shutil.ignore_patterns(".git", "out*"))
    folder = copy / "data" / "shakespeare_char"
    (folder / "input.txt").write_text(text, encoding="utf-8")
    subprocess.run([sys.executable, "prepare.py"], cwd=folder, check=True, capture_output=True)
    return copy


def run_nanogpt(copy: Path, iters: int, threads: int) -> tuple[float, torch.nn.Module]:
    """Run nanoGPT for ``iters`` iterations; return its wall time and its final model."""
    out_dir = copy / f"out-{iters}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    command = [sys.executable, "train.py", *NANOGPT_ARGS, f"--max_iters={iters}", f"--lr_decay_iters={iters}",
               "--always_save_checkpoint=True", f"--out_dir={out_dir}"]
    if iters % 250:  # a short trial run: evaluate (and so save) at its last iteration too
        command.append(f"--eval_interval={iters}")
    start = time.perf_counter()
    result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"nanoGPT failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    spec = importlib.util.spec_from_file_location("nanogpt_model", copy / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checkpoint = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=False)
    if checkpoint["iter_num"] != iters:
        raise RuntimeError(f"nanoGPT's checkpoint is from iteration {checkpoint['iter_num']}, not {iters}")
    model = module.GPT(module.GPTConfig(**checkpoint["model_args"]))
    state = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}
    model.load_state_dict(state)
    return seconds, model


def train_book(seconds: float, seed: int, train_ids, val_ids, vocab_size: int) -> tuple[float, float, int]:
    """Train the CPU profile for about ``seconds``; return (its score, the time it took, its steps)."""
    profile = cpu_profile(vocab_size)
    calibration = dataclasses.replace(profile.train, max_steps=30, warmup_steps=5, eval_interval=30,
                                      eval_batches=1)
    torch.manual_seed(seed)
    model = profile.new_model()  # with lib.cpu_kernels (the profile's config asks)
    train(model, train_ids, None, dataclasses.replace(calibration, max_steps=10), progress=False)  # warm
    start = time.perf_counter()  # (a first call in a process runs slower: allocations, thread start-up)
    train(model, train_ids, None, calibration, progress=False)
    per_step = (time.perf_counter() - start) / 30
    steps = max(100, int(seconds / per_step))
    config = dataclasses.replace(profile.train, max_steps=steps, eval_interval=steps, eval_batches=4,
                                 seed=seed)
    torch.manual_seed(seed)
    model = profile.new_model()  # with lib.cpu_kernels (the profile's config asks)
    start = time.perf_counter()
    train(model, train_ids, None, config, progress=False)
    return score(model, val_ids), time.perf_counter() - start, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("nanogpt_dir", type=Path)
    parser.add_argument("--iters", type=int, nargs="+", default=[2000, 5000],
                        help="nanoGPT iteration counts: the short and the long run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="the book's seeds")
    args = parser.parse_args()
    if not (args.nanogpt_dir / "train.py").exists():
        parser.error(f"{args.nanogpt_dir} is not a nanoGPT checkout (no train.py)")
    torch.set_num_threads(args.threads)

    text = data.load_text()
    tokenizer = CharTokenizer.from_text(text)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train_ids, val_ids = data.train_val_split(ids, val_fraction=0.1)

    names = ["short", "long"] if len(args.iters) == 2 else [f"n{n}" for n in args.iters]
    differences, spreads = {}, []
    with tempfile.TemporaryDirectory() as work:
        copy = prepare_nanogpt(args.nanogpt_dir, Path(work), text)
        nano_val = torch.from_numpy(np.fromfile(copy / "data/shakespeare_char/val.bin", dtype=np.uint16)
                                    .astype(np.int64))
        assert torch.equal(nano_val, val_ids), "nanoGPT's validation split differs from the book's"
        for name, iters in zip(names, args.iters):
            seconds, nano_model = run_nanogpt(copy, iters, args.threads)
            nano = score(nano_model, val_ids)
            print(f"{name}: nanoGPT {iters} iterations in {seconds:.1f} s -> {nano:.4f}", flush=True)
            book = []
            for seed in args.seeds:
                loss, took, steps = train_book(seconds, seed, train_ids, val_ids, tokenizer.vocab_size)
                book.append(loss)
                print(f"{name}: book CPU profile seed {seed}: {steps} steps in {took:.1f} s -> {loss:.4f}",
                      flush=True)
            differences[name] = nano - book[0]
            spreads.append(max(book) - min(book))
    print(f"book seed spread (max - min over seeds {args.seeds}): "
          + " ".join(f"{n}={s:.4f}" for n, s in zip(names, spreads)))
    print("nanogpt_minus_book: " + " ".join(f"{n}={d:.4f}" for n, d in differences.items()))


if __name__ == "__main__":
    main()
