"""Position-wise feed-forward networks: the GELU MLP (GPT-2) and SwiGLU (Llama).

Both act on every token independently: widen the vector from ``d_model`` to ``d_ff``, apply a
non-linearity, project back to ``d_model``. The non-linearity sits in a submodule called ``act``,
so a forward hook on ``.act`` captures the hidden activations.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lib.checks import check_choice, check_int, check_number

GELU_APPROXIMATIONS = ("none", "tanh")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Gaussian error linear unit, ``x * Phi(x)`` with ``Phi`` the standard normal CDF.

    ``approximate="none"`` uses the exact CDF (via ``erf``); ``"tanh"`` uses the tanh formula of
    the original GELU paper, which GPT-2 was trained with.
    """
    if approximate == "none":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


class GELU(nn.Module):
    """:func:`gelu` as a module (so that hooks can be attached to it).

    With ``fast=True`` (the default) it calls torch's fused ``F.gelu``, which computes the same
    function several times faster on a CPU; ``fast=False`` runs the written-out :func:`gelu`.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = check_choice("approximate", approximate, GELU_APPROXIMATIONS)
        self.approximate = approximate
        self.fast = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast:
            return F.gelu(x, approximate=self.approximate)
        return gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, fast={self.fast}"


def _check_sizes(d_model: int, d_ff: int, dropout: float) -> None:
    check_int("d_model", d_model)
    check_int("d_ff", d_ff)
    check_number("dropout", dropout, 0, 1, high_open=True)


class FeedForward(nn.Module):
    """The GPT-2 MLP: ``fc_out(act(fc_in(x)))`` with ``act`` GELU (exact or tanh) or ReLU."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = False,
                 dropout: float = 0.0) -> None:
        super().__init__()
        _check_sizes(d_model, d_ff, dropout)
        check_choice("activation", activation, ACTIVATIONS)
        self.fc_in = nn.Linear(d_model, d_ff, bias=bias)
        self.act = {"gelu": GELU("none"), "gelu_tanh": GELU("tanh"), "relu": nn.ReLU()}[activation]
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc_in(x))  # (B, T, C) -> (B, T, d_ff)
        return self.dropout(self.fc_out(h))  # (B, T, d_ff) -> (B, T, C)


class SwiGLU(nn.Module):
    """The gated MLP of Llama: ``w_down(silu(w_gate(x)) * w_up(x))``.

    The gate branch decides, feature by feature, how much of the up branch passes. With three
    matrices instead of two, ``d_ff`` is usually about 8/3 of ``d_model`` to keep the parameter
    count of a 4x GELU MLP.
    """

    def __init__(self, d_model: int, d_ff: int, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        _check_sizes(d_model, d_ff, dropout)
        self.w_gate = nn.Linear(d_model, d_ff, bias=bias)
        self.w_up = nn.Linear(d_model, d_ff, bias=bias)
        self.act = nn.SiLU()  # silu(z) = z * sigmoid(z)
        self.w_down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w_gate(x)) * self.w_up(x)  # (B, T, C) -> (B, T, d_ff)
        return self.dropout(self.w_down(h))  # (B, T, d_ff) -> (B, T, C)
