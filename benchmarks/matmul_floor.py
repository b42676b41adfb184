"""The matrix-multiply floor of one training step of the tiny shape on this CPU.

    .venv/bin/python benchmarks/matmul_floor.py [--threads 2] [--repeats 300] [--batch 12] [--context 64]

A training step of a GPT with N weights in its matrices on B x T tokens does about 6 N B T
multiply-adds' worth of FLOPs in matrix multiplies (forward 2, backward 4), whatever program runs it.
This script times every matrix product of one step of the tiny shape (4 layers, width 128,
feed-forward 512, 65 characters, tied head) at its real sizes, forward and both backward products,
and prints each shape's GFLOPS and the sum: the time a step cannot go below on this machine without
changing the shape, for nanoGPT and the book alike (``benchmarks/step_vs_nanogpt.py`` compares the
whole steps).
"""
from __future__ import annotations

import argparse
import time

import torch

LAYERS, C, FF, V = 4, 128, 512, 65


def seconds(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    for _ in range(20):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    M = args.batch * args.context  # tokens per step
    # (d_in, d_out, how many such matrices per step): q, k, v, out; fc_in; fc_out; the head.
    layers = [(C, C, 4 * LAYERS), (C, FF, LAYERS), (FF, C, LAYERS), (C, V, 1)]
    total_flops = total_seconds = 0.0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {M} tokens per step")
    for d_in, d_out, count in layers:
        x, w, g = torch.randn(M, d_in), torch.randn(d_in, d_out), torch.randn(M, d_out)
        products = {"forward x W": (x, w), "grad input g W^T": (g, w.t()),
                    "grad weight x^T g": (x.t(), g)}
        for name, (a, b) in products.items():
            t = seconds(a, b, args.repeats)
            flops = 2 * a.size(0) * a.size(1) * b.size(1)
            total_flops += count * flops
            total_seconds += count * t
            print(f"  {d_in:>3} -> {d_out:<3} x{count:<2} {name:<18} {flops / t / 1e9:6.1f} GFLOPS")
    weights = sum(d_in * d_out * count for d_in, d_out, count in layers)
    print(f"matrix weights N = {weights:,d}; 6 N x tokens = {6 * weights * M / 1e9:.2f} GFLOP "
          f"(timed: {total_flops / 1e9:.2f})")
    print(f"matrix-multiply floor of one step: {total_seconds * 1e3:.1f} ms "
          f"({total_flops / total_seconds / 1e9:.0f} GFLOPS on average)")


if __name__ == "__main__":
    main()
