"""The CPU kernel choices behind the book's fast training path, each measured against its alternative.

    .venv/bin/python benchmarks/cpu_kernels.py [--rounds 7] [--repeats 50] [--threads 2]

Every pair computes the same thing (or, for the two norms and the two activations, the same shape
of work) on the tiny model's shapes (width 128, 4 heads of 32, feed-forward 512) with a batch of 12
windows (nanoGPT's CPU configuration) and of 32 (the book's CPU profile). Each case times forward
and backward (or one optimizer step) over ``--repeats`` calls; the two sides of a pair run in
alternating rounds, so load from other jobs hits both alike, and the script prints the median time
of each side and the ratio ``baseline / choice`` (above 1: the lib's choice is faster).

* ``adamw``: ``torch.optim.AdamW`` with ``foreach=True`` against ``fused=True`` (what
  ``TrainConfig(fused_adamw=True)``, set by ``lib.profiles.cpu_profile``, picks on a CPU),
  one step on every parameter of ``GPTConfig.tiny``.
* ``attention T=..``: ``F.scaled_dot_product_attention(is_causal=True)`` against
  ``lib.cpu_kernels.causal_attention_bmm`` (what ``CPUMultiHeadAttention`` uses for sequences
  of at most ``BMM_MAX_POSITIONS`` positions).
* ``qkv``: three projections (``q_proj``, ``k_proj``, ``v_proj``) against one matmul with their
  weights stacked, as ``CPUMultiHeadAttention`` computes them.
* ``rope``: rotating queries and keys in two calls (as ``MultiHeadAttention`` does) against one
  call on queries and keys side by side (as ``CPUMultiHeadAttention`` does).
* ``layer``: the whole attention layer of the CPU profile's model (RoPE, 4 heads of 32, T=64),
  ``lib.attention.MultiHeadAttention`` against ``lib.cpu_kernels.CPUMultiHeadAttention``.
* ``rmsnorm / layernorm``: the lib's ``RMSNorm`` against ``LayerNorm(bias=False)``, both on
  their fused path (not the same function: this measures what the choice of norm costs).
* ``gelu / relu``: the same for the two activations.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lib.attention import MultiHeadAttention  # noqa: E402
from lib.cpu_kernels import CPUMultiHeadAttention, causal_attention_bmm  # noqa: E402
from lib.feedforward import GELU  # noqa: E402
from lib.model import GPT, GPTConfig  # noqa: E402
from lib.norms import LayerNorm, RMSNorm  # noqa: E402
from lib.positional import RotaryEmbedding  # noqa: E402

C, H, D, FF = 128, 4, 32, 512


def timed(fn: Callable[[], object], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def fwd_bwd(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    """A call running ``fn(*inputs)`` forward and backward (gradient of the sum of the output)."""
    def run() -> None:
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
    return run


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def adamw_pair() -> tuple[Callable, Callable]:
    model = GPT(GPTConfig.tiny(65, context_length=64))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3

    def optimizer(**kernel) -> Callable[[], None]:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, **kernel)
        return opt.step

    return optimizer(foreach=True), optimizer(fused=True)


def attention_pair(B: int, T: int) -> tuple[Callable, Callable]:
    q, k, v = leaf(B, H, T, D), leaf(B, H, T, D), leaf(B, H, T, D)
    flash = fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v)
    return flash, fwd_bwd(causal_attention_bmm, q, k, v)


def qkv_pair(B: int) -> tuple[Callable, Callable]:
    x = leaf(B, 64, C)
    wq, wk, wv = leaf(C, C), leaf(C, C), leaf(C, C)

    def separate(x, wq, wk, wv):
        return torch.cat([F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)], dim=-1)

    def stacked(x, wq, wk, wv):
        return F.linear(x, torch.cat([wq, wk, wv]))

    return fwd_bwd(separate, x, wq, wk, wv), fwd_bwd(stacked, x, wq, wk, wv)


def rope_pair(B: int) -> tuple[Callable, Callable]:
    rope = RotaryEmbedding(D)
    q, k = leaf(B, H, 64, D), leaf(B, H, 64, D)

    def two_calls(q, k):
        return torch.cat([rope(q), rope(k)], dim=1)

    def one_call(q, k):
        return rope(torch.cat([q, k], dim=1))

    return fwd_bwd(two_calls, q, k), fwd_bwd(one_call, q, k)


def layer_pair(B: int) -> tuple[Callable, Callable]:
    torch.manual_seed(0)
    plain = MultiHeadAttention(C, H, rope=RotaryEmbedding(D))
    cpu = CPUMultiHeadAttention(C, H, rope=RotaryEmbedding(D))  # what GPTConfig(cpu_kernels=True) builds
    cpu.load_state_dict(plain.state_dict())
    x = leaf(B, 64, C)
    return fwd_bwd(plain, x), fwd_bwd(cpu, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cases: dict[str, tuple[Callable, Callable]] = {"adamw (foreach / fused)": adamw_pair()}
    for B in (12, 32):
        for T in (64, 128, 256):
            cases[f"attention B={B} T={T} (sdpa / bmm)"] = attention_pair(B, T)
        cases[f"qkv B={B} (three / stacked)"] = qkv_pair(B)
        cases[f"rope q,k B={B} (two calls / one)"] = rope_pair(B)
        cases[f"layer B={B} (lib / cpu_kernels)"] = layer_pair(B)
        x = leaf(B, 64, C)
        cases[f"norm B={B} (rmsnorm / layernorm)"] = (fwd_bwd(RMSNorm(C), x),
                                                     fwd_bwd(LayerNorm(C, bias=False), x))
        h = leaf(B, 64, FF)
        cases[f"activation B={B} (gelu / relu)"] = (fwd_bwd(GELU(), h), fwd_bwd(torch.relu, h))

    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in cases}
    for baseline, choice in cases.values():  # warm-up
        baseline(), choice()
    for _ in range(args.rounds):
        for name, (baseline, choice) in cases.items():
            times[name][0].append(timed(baseline, args.repeats))
            times[name][1].append(timed(choice, args.repeats))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} alternating "
          f"rounds x {args.repeats} calls; median microseconds per call")
    for name, (base, choice) in times.items():
        b, c = statistics.median(base) * 1e6, statistics.median(choice) * 1e6
        print(f"{name:<38} {b:8.0f} {c:8.0f}   ratio {b / c:.2f}")


if __name__ == "__main__":
    main()
