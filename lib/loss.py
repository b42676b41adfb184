"""The training objective written out: log-softmax, cross-entropy, perplexity.

Cross-entropy is the average, over positions, of ``-log p(correct next token)``.
Computing ``log(softmax(x))`` naively overflows for large logits; subtracting the row
maximum first gives the same result (softmax does not change when a constant is added
to every logit) without overflow.

These are the formulas a chapter builds and shows; tests hold them against
``F.log_softmax`` and ``F.cross_entropy``. Training code (:meth:`lib.model.GPT.forward`,
fine-tuning) calls ``F.cross_entropy`` itself: torch's log-softmax and negative
log-likelihood kernels, which skip the Python-level steps of the formulas here.
"""
from __future__ import annotations

import math

import torch

__all__ = ["cross_entropy", "log_softmax", "perplexity"]


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log(softmax(x))`` along ``dim``, stable for any logits:
    ``z - log(sum(exp(z)))`` with ``z = x - max(x)``."""
    z = x - x.amax(dim=dim, keepdim=True)  # the largest entry becomes 0, so exp(z) <= 1
    return z - torch.log(torch.exp(z).sum(dim=dim, keepdim=True))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Mean of ``-log softmax(logits)[target]`` over positions, written out, in at least
    float32.

    ``logits`` ``(..., V)``, e.g. ``(B, T, V)``; ``targets`` the same shape without the
    last dimension, token ids in ``[0, V)``. Targets equal to ``ignore_index`` (padding)
    are left out of the mean, as in ``F.cross_entropy``; with none left it is NaN.
    """
    # At least float32: in bfloat16 the log-probabilities would be too coarse.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    keep = targets != ignore_index  # (...): the real targets
    safe = targets.long().masked_fill(~keep, 0)  # any valid id; its loss is dropped
    logp = log_softmax(logits, dim=-1)  # (..., V)
    nll = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # (...)
    return nll.masked_fill(~keep, 0.0).sum() / keep.sum()


def perplexity(loss: float | torch.Tensor) -> float | torch.Tensor:
    """``exp(loss)``: the number of equally likely tokens the model is, on average,
    choosing among. A float gives a float, a tensor a tensor. Uniform over V: V."""
    return torch.exp(loss) if isinstance(loss, torch.Tensor) else math.exp(loss)
