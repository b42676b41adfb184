"""Normalisation layers: LayerNorm (GPT-2) and RMSNorm (Llama), written out in plain
torch.

Both rescale each token's vector (the last dimension) to a standard size and then apply
a learned per-feature gain. LayerNorm first removes the mean and also learns a shift;
RMSNorm only divides by the root mean square. The written-out statistics are computed in
at least float32, so the layers stay accurate when the rest of the model runs in
bfloat16 or float16.

By default (``fused=True``) ``forward`` hands the same computation to torch's own
function when input and weight share a dtype: ``F.layer_norm``, one fused kernel,
several times faster on a CPU; ``F.rms_norm``, which on a CPU still runs as a handful of
operations (torch 2.13), so there RMSNorm costs more time than LayerNorm despite its
smaller arithmetic (``benchmarks/cpu_kernels.py``). ``fused=False`` runs the formula
written out. The tests check both paths against ``nn.LayerNorm`` / ``nn.RMSNorm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lib.checks import check_int, check_number

__all__ = ["LayerNorm", "RMSNorm"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs, the input's own dtype otherwise (float32,
    float64)."""
    return torch.promote_types(x.dtype, torch.float32)


class LayerNorm(nn.Module):
    """Layer normalisation over the last dimension:
    ``(x - mean) / sqrt(var + eps) * weight + bias``.

    The variance is the biased one (divide by ``d``), as in ``nn.LayerNorm``.
    ``bias=False`` drops the learned shift (some GPT variants do).
    """

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.d = check_int("d", d)
        self.eps = check_number("eps", eps, low=0, low_open=True)
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None
        self.fused = True  # False: the written-out formula

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == self.weight.dtype:  # the same formula, one kernel
            return F.layer_norm(x, (self.d,), self.weight, self.bias, self.eps)
        h = x.to(_compute_dtype(x))
        mean = h.mean(dim=-1, keepdim=True)  # (..., 1)
        var = (h - mean).pow(2).mean(dim=-1, keepdim=True)  # (..., 1), biased variance
        h = (h - mean) * torch.rsqrt(var + self.eps)  # (..., d): mean 0, variance 1
        h = h * self.weight
        if self.bias is not None:
            h = h + self.bias
        return h.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.d}, eps={self.eps}, bias={self.bias is not None}, "
                f"fused={self.fused}")


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension:
    ``x / sqrt(mean(x**2) + eps) * weight``.

    No mean subtraction and no bias: less arithmetic than LayerNorm and, in practice,
    just as good.
    """

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.d = check_int("d", d)
        self.eps = check_number("eps", eps, low=0, low_open=True)
        self.weight = nn.Parameter(torch.ones(d))
        self.fused = hasattr(F, "rms_norm")  # torch >= 2.4; False: written out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == self.weight.dtype:  # the same formula, fused
            return F.rms_norm(x, (self.d,), self.weight, self.eps)
        h = x.to(_compute_dtype(x))
        ms = h.pow(2).mean(dim=-1, keepdim=True)  # (..., 1), mean square
        h = h * torch.rsqrt(ms + self.eps) * self.weight  # (..., d)
        return h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}, fused={self.fused}"
