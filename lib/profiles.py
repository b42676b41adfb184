"""The book's two training profiles: what chapter 11 trains on a CPU and on a GPU.

A profile is a model config and a training config, chosen together:

- :func:`cpu_profile`: the tiny shape (4 layers, 4 heads, width 128) with rotary positions and no
  biases, which learn faster per step, a short context (64 characters) so each step is cheap, and a
  high learning rate. The norm stays LayerNorm (without bias): torch's RMSNorm runs as several
  operations on a CPU and costs about 2.5 times LayerNorm's fused kernel there
  (``benchmarks/cpu_kernels.py``). It turns on the CPU speed-ups of :mod:`lib.cpu_kernels`:
  fused AdamW (``TrainConfig.fused_adamw``) and the CPU attention path
  (``GPTConfig.cpu_kernels``). This is what CI executes and what ``benchmarks/train_vs_nanogpt.py`` races
  against nanoGPT; the settings were picked by a sweep at equal wall time recorded in
  ``docs/benchmarks.md``.
- :func:`gpu_profile`: a larger model (6 layers, 6 heads, width 384, context 256, dropout 0.2, like
  nanoGPT's Shakespeare GPU config) with bf16 autocast, ``torch.compile`` and fused AdamW, which
  :func:`lib.training.train` switches on for CUDA.

Chapters choose with ``env.pick(cpu=cpu_profile(V), gpu=gpu_profile(V))``; both return a
:class:`Profile` whose ``train.max_steps`` is a default the caller may replace.
"""
from __future__ import annotations

from dataclasses import dataclass

from lib.config import GPTConfig, TrainConfig
from lib.model import GPT

__all__ = ["Profile", "cpu_profile", "gpu_profile"]


@dataclass(frozen=True)
class Profile:
    """A model config and a training config."""

    model: GPTConfig
    train: TrainConfig

    def new_model(self) -> GPT:
        """A freshly initialised :class:`lib.model.GPT` of this profile's config."""
        return GPT(self.model)


def cpu_profile(vocab_size: int = 65, max_steps: int = 2000) -> Profile:
    """The CPU profile: the tiny shape with RoPE, context 64, batch 32, learning rate 1e-2,
    fused AdamW and the CPU attention path."""
    model = GPTConfig.tiny(vocab_size=vocab_size, context_length=64, positions="rope", norm="layernorm",
                           bias=False, dropout=0.0, cpu_kernels=True)
    train = TrainConfig(max_steps=max_steps, batch_size=32, context_length=64, lr=1e-2, min_lr=1e-3,
                        warmup_steps=50, weight_decay=0.1, betas=(0.9, 0.95), grad_clip=1.0,
                        eval_interval=max(max_steps // 10, 1), eval_batches=8, seed=0,
                        fused_adamw=True)
    return Profile(model=model, train=train)


def gpu_profile(vocab_size: int = 65, max_steps: int = 1000) -> Profile:
    """The GPU profile: 6 layers x 6 heads x 384 wide, context 256, dropout 0.2, batch 64, bf16
    autocast, ``torch.compile`` and fused AdamW. The default length, 1000 steps, is where the
    validation loss on TinyShakespeare is still falling (measured on an H200, in
    ``docs/benchmarks.md``); by 2000 steps it has turned up."""
    model = GPTConfig(vocab_size=vocab_size, context_length=256, d_model=384, n_layers=6, n_heads=6,
                      d_ff=1536, norm="rmsnorm", ffn="gelu", positions="rope", tie_embeddings=True,
                      dropout=0.2, bias=False)
    train = TrainConfig(max_steps=max_steps, batch_size=64, context_length=256, lr=1e-3, min_lr=1e-4,
                        warmup_steps=100, weight_decay=0.1, betas=(0.9, 0.99), grad_clip=1.0,
                        eval_interval=max(max_steps // 10, 1), eval_batches=20, seed=0, amp=True,
                        compile=True)
    return Profile(model=model, train=train)
