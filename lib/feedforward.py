"""Position-wise feed-forward networks: the GELU MLP (GPT-2), SwiGLU (Llama) and a
mixture of SwiGLU experts.

Each acts on every token independently: widen the vector from ``d_model`` to ``d_ff``,
apply a non-linearity, project back to ``d_model``. The non-linearity sits in a
submodule called ``act``: in the two-matrix MLP a forward hook on ``.act`` captures the
hidden activations; in SwiGLU it sees only the gate branch, and the hidden activations
(what ``w_down`` reads) are its output times the up branch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward", "GELU", "MoE", "SwiGLU", "gelu", "with_aux_loss"]


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Gaussian error linear unit, ``x * Phi(x)`` with ``Phi`` the standard normal CDF.

    ``approximate="none"`` uses the exact CDF (via ``erf``); ``"tanh"`` uses the tanh
    formula of the original GELU paper, which GPT-2 was trained with.
    """
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))
        return 0.5 * x * (1.0 + torch.tanh(inner))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


class GELU(nn.Module):
    """:func:`gelu` as a module (so that hooks can be attached to it), through torch's
    ``F.gelu``, which computes the same function several times faster on a CPU."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class FeedForward(nn.Module):
    """The GPT-2 MLP: ``fc_out(act(fc_in(x)))`` with ``act`` GELU (exact or tanh) or
    ReLU."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu",
                 bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_model, d_ff, bias=bias)
        self.act = {"gelu": GELU("none"), "gelu_tanh": GELU("tanh"),
                    "relu": nn.ReLU()}[activation]
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc_in(x))  # (B, T, C) -> (B, T, d_ff)
        return self.dropout(self.fc_out(h))  # (B, T, d_ff) -> (B, T, C)


class SwiGLU(nn.Module):
    """The gated MLP of Llama: ``w_down(silu(w_gate(x)) * w_up(x))``.

    The gate branch decides, feature by feature, how much of the up branch passes. With
    three matrices instead of two, ``d_ff`` is usually about 8/3 of ``d_model`` to keep
    the parameter count of a 4x GELU MLP.
    """

    def __init__(self, d_model: int, d_ff: int, bias: bool = False,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=bias)
        self.w_up = nn.Linear(d_model, d_ff, bias=bias)
        self.act = nn.SiLU()  # silu(z) = z * sigmoid(z)
        self.w_down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w_gate(x)) * self.w_up(x)  # (B, T, C) -> (B, T, d_ff)
        return self.dropout(self.w_down(h))  # (B, T, d_ff) -> (B, T, C)


class _AuxLoss(torch.autograd.Function):
    """Identity on ``y`` going forward; going backward, ``aux`` also gets gradient 1."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad_y, torch.ones_like(aux)


def with_aux_loss(y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``y`` itself, with ``aux`` (0-dim) attached to the backward pass: a
    ``backward()`` that reaches ``y`` also gives ``aux`` the gradient 1. Started from
    the loss itself (``loss.backward()``), that is the gradient of ``loss + aux``, while
    the loss's value stays as it is. DeepSeek-V2's ``modeling_deepseek.py``
    (``AddAuxiliaryLoss``) attaches its balancing loss this way; Megatron-LM's
    ``MoEAuxLossAutoScaler`` also scales that gradient with the main loss's scale."""
    return _AuxLoss.apply(y, aux)


class MoE(nn.Module):
    """A mixture of experts: ``n_experts`` SwiGLU networks and a router that sends each
    token to ``top_k`` of them.

    For a token ``x`` the router computes probabilities ``p = softmax(x W_r)`` over the
    experts and keeps the ``top_k`` largest. Their gates ``g``: with ``top_k=1`` the
    chosen expert's probability itself (the Switch Transformer); with ``top_k >= 2`` the
    kept probabilities renormalised to sum to 1 (Mixtral). The output is
    ``sum_i g_i * expert_i(x)`` over the chosen experts. Only the chosen experts work on
    a token, so it uses ``top_k / n_experts`` of the experts' parameters.

    The experts are kept busy alike by the Switch Transformer load-balancing loss
    (:meth:`balancing_loss`), which is 1 when routing is uniform and grows as the load
    concentrates. In training mode ``forward`` adds ``aux_weight`` times its gradient to
    the backward pass (:func:`with_aux_loss`); the output, and so the model's loss, is
    unchanged. For plots, ``expert_counts`` ``(n_experts,)`` keeps how many assignments
    each expert received in the last batch.
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int,
                 bias: bool = False, dropout: float = 0.0,
                 aux_weight: float = 0.01) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.d_model = n_experts, top_k, d_model
        self.aux_weight = aux_weight
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, d_ff, bias=bias)
                                     for _ in range(n_experts))
        self.dropout = nn.Dropout(dropout)
        self.expert_counts: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routing of tokens ``x`` ``(N, C)``: ``probs (N, E)``, ``experts (N, k)``,
        ``gates (N, k)``.

        ``probs`` is the router's softmax over all experts (float32), ``experts`` the
        indices of the ``k`` most probable, ``gates`` their weights. One expert is gated
        by its probability: renormalised, a single gate would be ``p / p = 1`` whatever
        the router said, and the task loss would send the router no gradient. Two or
        more are renormalised to sum to 1.
        """
        probs = torch.softmax(self.router(x).float(), dim=-1)  # (N, E)
        top_p, experts = probs.topk(self.top_k, dim=-1)  # (N, k) each
        if self.top_k == 1:
            return probs, experts, top_p
        return probs, experts, top_p / top_p.sum(dim=-1, keepdim=True)

    def balancing_loss(self, probs: torch.Tensor,
                       experts: torch.Tensor) -> torch.Tensor:
        """The Switch Transformer load-balancing loss ``n_experts * sum_e f_e P_e``
        (0-dim) of one routing (:meth:`route`): ``f_e`` the fraction of the (token,
        slot) assignments that went to expert ``e``, ``P_e`` its mean router
        probability. Only ``P_e`` carries a gradient."""
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)  # (E,)
        fraction = counts.float() / experts.numel()  # f_e, sums to 1
        return self.n_experts * (fraction * probs.mean(dim=0)).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, T, C)`` -> ``(B, T, C)``."""
        flat = x.reshape(-1, self.d_model)  # (N, C), N = B * T tokens
        probs, experts, gates = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (experts == e).nonzero(as_tuple=True)  # tokens sent to e
            # An expert without tokens still runs, on an empty batch: its parameters
            # stay in the autograd graph (zero gradient), as DDP requires.
            y = expert(flat[token]) * gates[token, slot, None]  # (n_e, C), gated
            out.index_add_(0, token, y.to(out.dtype))
        self.expert_counts = torch.bincount(experts.flatten(), minlength=self.n_experts)
        out = self.dropout(out.reshape(x.shape))
        if self.training:  # the balancing loss joins the gradient, not the output
            aux = self.aux_weight * self.balancing_loss(probs, experts)
            out = with_aux_loss(out, aux)
        return out

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, top_k={self.top_k}"
