"""Muon: momentum SGD whose update for a weight matrix is orthogonalised by a Newton–Schulz iteration.

- :func:`newton_schulz`: an approximately orthogonal matrix with the singular vectors of ``G`` (all
  singular values pushed towards 1), computed with five matrix polynomials instead of an SVD.
- :class:`MuonAdamW`: one optimizer with two kinds of parameter groups. Groups marked
  ``use_muon=True`` (hidden weight matrices) take Muon steps; the others (embeddings, the output
  head, norm gains, biases) take AdamW steps. :func:`lib.training.configure_optimizer` builds it
  for ``optimizer='muon'``.

The Muon step follows ``torch.optim.Muon`` (Nesterov momentum 0.95, five quintic Newton–Schulz
steps in bfloat16, decoupled weight decay) with its ``adjust_lr_fn='match_rms_adamw'`` scaling
(``0.2 * sqrt(max(rows, cols))``), so both kinds of groups share one learning rate and schedule.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from lib.checks import check_number

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic a, b, c of torch.optim.Muon


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately orthogonalise a matrix ``G`` ``(m, n)``: same shape, in ``dtype``.

    ``X = G / ||G||_F`` (so every singular value is at most 1), then ``steps`` times
    ``X <- a X + (b A + c A A) X`` with ``A = X X^T`` (on the wide orientation, ``m <= n``). Each
    step maps every singular value ``s`` to ``a s + b s^3 + c s^5``, which pushes it towards 1
    while leaving the singular vectors alone. (No checks: every Muon step calls it for every
    matrix; :class:`MuonAdamW` checks once that its Muon groups hold only matrices.)
    """
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T  # work on the wide orientation: A = X X^T is the smaller Gram matrix
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A A
        X = torch.addmm(X, B, X, beta=a)  # a X + B X
    return X.T if tall else X


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the parameter groups with ``use_muon=True`` (2-D matrices only), AdamW for the rest.

    Per-group options: ``lr``, ``weight_decay``; Muon groups also ``momentum`` (0.95), ``nesterov``
    (True), ``ns_steps`` (5); AdamW groups ``betas``, ``eps``. Weight decay is decoupled in both:
    ``p <- p * (1 - lr * weight_decay)`` before the update.
    """

    def __init__(self, params: Iterable[dict[str, Any]], lr: float = 1e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5) -> None:
        check_number("lr", lr, low=0, low_open=True)
        check_number("momentum", momentum, 0, 1, high_open=True)
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, use_muon=False)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("params: a group with use_muon=True may hold only 2-D matrices, got shapes "
                                 f"{[tuple(p.shape) for p in group['params'] if p.dim() != 2]}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            update = self._muon_update if group["use_muon"] else self._adamw_update
            for p in group["params"]:
                if p.grad is not None:
                    p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled weight decay
                    update(p, self.state[p], group)
        return loss

    @staticmethod
    def _muon_update(p: torch.Tensor, state: dict, group: dict) -> None:
        """``p -= lr * 0.2 sqrt(max(m, n)) * NS(Nesterov momentum of the gradient)``."""
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        momentum, buffer = group["momentum"], state["momentum_buffer"]
        buffer.lerp_(p.grad, 1 - momentum)  # B = mu B + (1 - mu) G
        direction = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        orthogonal = newton_schulz(direction, group["ns_steps"]).to(p.dtype)
        rms_match = 0.2 * math.sqrt(max(p.shape))  # update RMS comparable to AdamW's
        p.add_(orthogonal, alpha=-group["lr"] * rms_match)

    @staticmethod
    def _adamw_update(p: torch.Tensor, state: dict, group: dict) -> None:
        """``p -= lr * m_hat / (sqrt(v_hat) + eps)``, Adam's bias-corrected moments."""
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = float(state["step"])
        state["exp_avg"].lerp_(p.grad, 1 - beta1)  # m
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)  # v
        denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** t))
