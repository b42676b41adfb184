"""The training objective written out: log-softmax, cross-entropy, perplexity.

Cross-entropy is the average, over positions, of ``-log p(correct next token)``. Computing
``log(softmax(x))`` naively overflows for large logits; subtracting the row maximum first gives the
same result (softmax does not change when a constant is added to every logit) without overflow.
"""
from __future__ import annotations

import math

import torch


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log(softmax(x))`` along ``dim``, stable for any logits: ``z - log(sum(exp(z)))``, z = x - max."""
    z = x - x.amax(dim=dim, keepdim=True)  # the largest entry becomes 0, so exp(z) <= 1
    return z - torch.log(torch.exp(z).sum(dim=dim, keepdim=True))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` under ``softmax(logits)``.

    ``logits`` has shape ``(..., V)`` (e.g. ``(B, T, V)`` or ``(N, V)``), ``targets`` the same shape
    without the last dimension, holding ids in ``[0, V)``. Returns a scalar tensor.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError("logits must be a floating-point tensor of shape (..., V)")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex():
        raise TypeError("targets must be an integer tensor of token ids")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(logits.shape[:-1])} (logits without the last "
                         f"dimension), got {tuple(targets.shape)}")
    if targets.numel() == 0:
        raise ValueError("targets must hold at least one token id (the mean of no losses is undefined)")
    V = logits.size(-1)
    if (targets.min() < 0 or targets.max() >= V):
        raise ValueError(f"targets must hold token ids in [0, {V}), got values in "
                         f"[{int(targets.min())}, {int(targets.max())}]")
    # At least float32: in bfloat16 (mixed precision) the log-probabilities would be too coarse.
    logp = log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (..., V)
    logp_correct = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # (...)
    return -logp_correct.mean()


def perplexity(loss: float | torch.Tensor) -> float | torch.Tensor:
    """``exp(loss)``: the number of equally likely tokens the model is, on average, choosing among.

    A float gives a float, a tensor gives a tensor. A uniform guess over V tokens has perplexity V.
    """
    if isinstance(loss, torch.Tensor):
        return torch.exp(loss)
    if not isinstance(loss, (int, float)) or isinstance(loss, bool):
        raise TypeError(f"loss must be a float or a tensor, got {type(loss).__name__}")
    return math.exp(loss)
