"""Training throughput of the tiny character model: fused kernels vs the explicit formulas.

Measures tokens per second for whole optimisation steps (forward, backward, gradient clipping and
an AdamW step) of ``GPTConfig.tiny`` as lib runs it (torch's kernels: ``F.scaled_dot_product_attention``,
"fused") and with the attention replaced, in this script, by lib's written-out formula
``lib.attention.scaled_dot_product_attention`` (matmul + mask + softmax + matmul, "explicit").
``--switch all`` also replaces the norms, GELU and the loss by ``lib.norms.layer_norm``,
``lib.feedforward.gelu`` and ``lib.loss.cross_entropy``. The two paths run on the same weights and batch, in
alternating rounds, so load from other jobs on the machine affects both alike; the script reports
the median of each and their ratio, by wall clock and by process CPU time.

    .venv/bin/python benchmarks/train_throughput.py [--batch-size 16] [--steps 5] [--rounds 7] [--threads N]
        [--context-length T] [--switch attention|all]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lib.attention import scaled_dot_product_attention  # noqa: E402
from lib.feedforward import GELU, gelu  # noqa: E402
from lib.loss import cross_entropy  # noqa: E402
from lib.model import GPT, GPTConfig  # noqa: E402
from lib.norms import LayerNorm, layer_norm  # noqa: E402
from lib.training import configure_optimizer  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _explicit_attention(self, x: torch.Tensor, offset: int = 0, kv_cache=None) -> torch.Tensor:
    B, T, C = x.shape
    q, k, v = self.project(x, offset, kv_cache)
    mask, causal = self.mask(T, k.size(2), x.device)
    y, _ = scaled_dot_product_attention(q, k, v, mask=mask, causal=causal)
    return self.resid_dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, C)))


def _explicit_norm(self, x: torch.Tensor) -> torch.Tensor:
    return layer_norm(x, self.weight, self.bias, self.eps)


def _explicit_gelu(self, x: torch.Tensor) -> torch.Tensor:
    return gelu(x, self.approximate)


def select_path(model: GPT, fast: bool, switch: str) -> None:
    """Torch's kernels (``fast``: lib's own forwards) or the written-out formulas bound in their
    place on this model's instances: attention alone, or (``switch='all'``) norms and GELU too."""
    attention_layers = [block.attn for block in model.blocks]
    for module in model.modules():
        module.__dict__.pop("forward", None)  # back to the class's forward
        if fast:
            continue
        if any(module is layer for layer in attention_layers):
            module.forward = types.MethodType(_explicit_attention, module)
        elif switch == "all" and isinstance(module, LayerNorm):
            module.forward = types.MethodType(_explicit_norm, module)
        elif switch == "all" and isinstance(module, GELU):
            module.forward = types.MethodType(_explicit_gelu, module)


def loss_of(model: GPT, x: torch.Tensor, y: torch.Tensor, fast: bool, switch: str) -> torch.Tensor:
    """The training loss: GPT.forward's F.cross_entropy, or lib.loss.cross_entropy written out."""
    if fast or switch != "all":
        return model(x, y)[1]
    return cross_entropy(model(x)[0], y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="optimisation steps per timed round")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per path (alternating)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="override the preset's context length (128), e.g. to see longer sequences")
    parser.add_argument("--switch", choices=("attention", "all"), default="attention",
                        help="what the explicit path replaces: attention only, or every fused kernel")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    overrides = {} if args.context_length is None else {"context_length": args.context_length}
    config = GPTConfig.tiny(vocab_size=65, **overrides)
    model = GPT(config)
    optimizer = configure_optimizer(model, lr=1e-3, weight_decay=0.1)
    B, T = args.batch_size, config.context_length
    x = torch.randint(0, config.vocab_size, (B, T))
    y = torch.randint(0, config.vocab_size, (B, T))

    # Same weights, same batch: both paths compute the same loss (up to float rounding).
    losses = {}
    for fast in (True, False):
        select_path(model, fast, args.switch)
        with torch.no_grad():
            losses[fast] = loss_of(model, x, y, fast, args.switch).item()
    print(f"loss fused {losses[True]:.6f}, explicit {losses[False]:.6f}, "
          f"|diff| {abs(losses[True] - losses[False]):.2e}")

    def steps(n: int, fast: bool) -> None:
        for _ in range(n):
            loss = loss_of(model, x, y, fast, args.switch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    results: dict[bool, dict[str, list[float]]] = {True: {"wall": [], "cpu": []}, False: {"wall": [], "cpu": []}}
    for fast in (True, False):  # warm-up: first-call allocations and kernel selection
        select_path(model, fast, args.switch)
        steps(2, fast)
    for _ in range(args.rounds):
        for fast in (True, False):
            select_path(model, fast, args.switch)
            wall, cpu = time.perf_counter(), time.process_time()
            steps(args.steps, fast)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            results[fast]["wall"].append(B * T * args.steps / wall)
            results[fast]["cpu"].append(B * T * args.steps / cpu)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_name()}")
    print(f"GPTConfig.tiny(context_length={T}): {model.num_parameters():,} parameters, batch {B} x {T} tokens, "
          f"{args.rounds} rounds x {args.steps} steps per path, switch: {args.switch}")
    for clock in ("wall", "cpu"):
        fused = statistics.median(results[True][clock])
        explicit = statistics.median(results[False][clock])
        unit = "tokens/s" if clock == "wall" else "tokens per CPU-second"
        print(f"{clock:>4}: fused {fused:,.0f} {unit}, explicit {explicit:,.0f} {unit}, "
              f"fused/explicit = {fused / explicit:.2f}x")
    per_round = [f / e for f, e in zip(results[True]["wall"], results[False]["wall"])]
    print("per-round wall ratios:", " ".join(f"{r:.2f}" for r in per_round))


if __name__ == "__main__":
    main()
