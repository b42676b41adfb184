"""The training objective written out: log-softmax, cross-entropy, perplexity.

Cross-entropy is the average, over positions, of ``-log p(correct next token)``.
Computing ``log(softmax(x))`` naively overflows for large logits; subtracting the row
maximum first gives the same result (softmax does not change when a constant is added
to every logit) without overflow.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lib.checks import check_token_ids


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log(softmax(x))`` along ``dim``, stable for any logits:
    ``z - log(sum(exp(z)))`` with ``z = x - max(x)``."""
    z = x - x.amax(dim=dim, keepdim=True)  # the largest entry becomes 0, so exp(z) <= 1
    return z - torch.log(torch.exp(z).sum(dim=dim, keepdim=True))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  fused: bool = False) -> torch.Tensor:
    """Mean of ``-log softmax(logits)[target]`` over positions, in at least float32.

    ``logits`` ``(..., V)``, e.g. ``(B, T, V)``; ``targets`` the same shape without the
    last dimension, token ids in ``[0, V)``. Targets equal to ``ignore_index`` (padding)
    are left out of the mean, as in ``F.cross_entropy``; with none left it is NaN.
    ``fused=True`` hands the same computation to torch's ``F.cross_entropy``. The ids'
    range is checked where data enters (``train``, ``generate``), not at every step.
    """
    check_token_ids("targets", targets)  # the type only: values would sync a GPU
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(logits.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    V = logits.size(-1)
    # At least float32: in bfloat16 the log-probabilities would be too coarse.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if fused:
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1).long(),
                               ignore_index=ignore_index)
    keep = targets != ignore_index  # (...): the real targets
    safe = targets.long().masked_fill(~keep, 0)  # any valid id; its loss is dropped
    logp = log_softmax(logits, dim=-1)  # (..., V)
    nll = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # (...)
    return nll.masked_fill(~keep, 0.0).sum() / keep.sum()


def perplexity(loss: float | torch.Tensor) -> float | torch.Tensor:
    """``exp(loss)``: the number of equally likely tokens the model is, on average,
    choosing among. A float gives a float, a tensor a tensor. Uniform over V: V."""
    if isinstance(loss, torch.Tensor):
        return torch.exp(loss)
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise TypeError(f"loss must be a float or a tensor, got {type(loss).__name__}")
    return math.exp(loss)
