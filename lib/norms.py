"""Normalisation layers: LayerNorm (GPT-2) and RMSNorm (Llama).

Both rescale each token's vector (the last dimension) to a standard size and then apply
a learned per-feature gain. LayerNorm first removes the mean and also learns a shift;
RMSNorm only divides by the root mean square.

- :func:`layer_norm` and :func:`rms_norm`: the formulas written out, with the statistics
  in at least float32. Chapters build and show them; tests hold them against
  ``nn.LayerNorm`` and ``nn.RMSNorm``.
- :class:`LayerNorm` and :class:`RMSNorm`: the layers a model uses. Their ``forward`` is
  torch's kernel, ``F.layer_norm`` or ``F.rms_norm`` (on a CPU the latter still runs as a
  handful of operations, so there RMSNorm costs more time than LayerNorm despite its
  smaller arithmetic; ``benchmarks/cpu_kernels.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm"]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension, written
    out; the variance is the biased one (divide by ``d``), as in ``nn.LayerNorm``.
    In at least float32, returned in ``x``'s dtype; ``(..., d) -> (..., d)``."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    mean = h.mean(dim=-1, keepdim=True)  # (..., 1)
    var = (h - mean).pow(2).mean(dim=-1, keepdim=True)  # (..., 1), biased variance
    h = (h - mean) * torch.rsqrt(var + eps) * weight  # mean 0, variance 1, times a gain
    if bias is not None:
        h = h + bias
    return h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, written out.
    In at least float32, returned in ``x``'s dtype; ``(..., d) -> (..., d)``."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    ms = h.pow(2).mean(dim=-1, keepdim=True)  # (..., 1), mean square
    return (h * torch.rsqrt(ms + eps) * weight).to(x.dtype)  # (..., d)


class LayerNorm(nn.Module):
    """Layer normalisation over the last ``d`` features (:func:`layer_norm`), through
    ``F.layer_norm``. ``bias=False`` drops the learned shift (some GPT variants do)."""

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.d, self.eps = d, eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.d,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last ``d`` features (:func:`rms_norm`),
    through ``F.rms_norm``: no mean subtraction and no bias, less arithmetic than
    LayerNorm and, in practice, just as good."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.d, self.eps = d, eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.d,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"
