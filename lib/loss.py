"""The training objective written out: log-softmax, cross-entropy, perplexity.

Cross-entropy is the average, over positions, of ``-log p(correct next token)``. Computing
``log(softmax(x))`` naively overflows for large logits; subtracting the row maximum first gives the
same result (softmax does not change when a constant is added to every logit) without overflow.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lib.checks import check_id_range, check_int, check_token_ids, check_type


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log(softmax(x))`` along ``dim``, stable for any logits: ``z - log(sum(exp(z)))``, z = x - max."""
    z = x - x.amax(dim=dim, keepdim=True)  # the largest entry becomes 0, so exp(z) <= 1
    return z - torch.log(torch.exp(z).sum(dim=dim, keepdim=True))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int | None = None,
                  fast: bool = False) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` under ``softmax(logits)``.

    ``logits`` has shape ``(..., V)`` (e.g. ``(B, T, V)`` or ``(N, V)``), ``targets`` the same shape
    without the last dimension, holding ids in ``[0, V)``. Returns a scalar tensor, computed in at
    least float32.

    ``ignore_index``: targets equal to it (padding) are left out, and the mean is over the others,
    as in ``F.cross_entropy(..., ignore_index=...)``; when every target is ignored the mean of no
    losses is NaN, as in torch. ``fast=True`` hands the same computation to torch's fused
    ``F.cross_entropy``; ``GPT.set_fast`` chooses it for the model's loss.

    The targets' range is checked when they are on the CPU. On a GPU, reading them would make every
    training step wait for the device; there the data is checked once where it enters (``train``).
    """
    check_type("logits", logits, torch.Tensor, "floating-point tensor of shape (..., V)")
    if not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError("logits must be a floating-point tensor of shape (..., V)")
    check_token_ids("targets", targets)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(logits.shape[:-1])} (logits without the last "
                         f"dimension), got {tuple(targets.shape)}")
    if targets.numel() == 0:
        raise ValueError("targets must hold at least one token id (the mean of no losses is undefined)")
    check_int("ignore_index", ignore_index, minimum=None, optional=True)
    V = logits.size(-1)
    if targets.device.type == "cpu":
        check_id_range("targets", targets, V, ignore_index)
    # At least float32: in bfloat16 (mixed precision) the log-probabilities would be too coarse.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if fast:
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1).long(),
                               ignore_index=-100 if ignore_index is None else ignore_index)
    keep = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None else targets != ignore_index
    safe_targets = targets.long().masked_fill(~keep, 0)  # any valid id; its loss is dropped below
    logp = log_softmax(logits, dim=-1)  # (..., V)
    logp_correct = logp.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)  # (...)
    return -logp_correct.masked_fill(~keep, 0.0).sum() / keep.sum()


def perplexity(loss: float | torch.Tensor) -> float | torch.Tensor:
    """``exp(loss)``: the number of equally likely tokens the model is, on average, choosing among.

    A float gives a float, a tensor gives a tensor. A uniform guess over V tokens has perplexity V.
    """
    if isinstance(loss, torch.Tensor):
        return torch.exp(loss)
    if isinstance(loss, bool):
        raise TypeError("loss must be a float or a tensor, got bool")
    return math.exp(check_type("loss", loss, (int, float), "float or a tensor"))
