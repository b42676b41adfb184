"""Low-rank adaptation (LoRA): fine-tune a few small matrices beside frozen weights.

A weight matrix ``W (out, in)`` stays frozen; beside it sit two trainable matrices,
``A (r, in)`` and ``B (out, r)`` with a small rank ``r``, and the layer computes

    y = x W^T + b + (alpha / r) * x A^T B^T

``B`` starts at zero, so a freshly wrapped model computes exactly what it did before.
Training updates only ``A`` and ``B``: ``r * (in + out)`` numbers, not ``in * out``.
Afterwards the update can be folded into the weight, ``W + (alpha / r) B A``, leaving
a plain ``nn.Linear`` that costs nothing extra at inference (:func:`merge_lora`). The
scale ``alpha / r`` is LoRA's (Hu et al. 2021); rank-stabilised LoRA (Kalajdzievski
2023) uses ``alpha / sqrt(r)``: this layer with ``alpha`` set to ``alpha' * sqrt(r)``.

- :class:`LoRALinear`: the wrapper around one ``nn.Linear``.
- :func:`apply_lora`: wrap the named linear layers of a model, freeze everything else.
- :func:`merge_lora`: fold every adapter into its weight.
- :func:`lora_state_dict`: the adapter tensors alone (what a LoRA checkpoint stores).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from lib.checks import check_number, check_type
from lib.cpu_kernels import CPUMultiHeadAttention

__all__ = ["ATTENTION", "FFN", "SWIGLU", "LoRALinear", "apply_lora", "merge_lora",
           "lora_state_dict"]

# Names of lib's linear layers (the last part of a module's dotted name), for targets:
# attention's four projections, the two-matrix MLP's layers, SwiGLU's three.
ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")
FFN = ("fc_in", "fc_out")
SWIGLU = ("w_gate", "w_up", "w_down")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` (``base``) plus a trainable update ``(alpha / r) B A``.

    ``lora_A`` ``(r, in_features)`` starts like an ``nn.Linear`` weight, ``lora_B``
    ``(out_features, r)`` at zero, so the output starts equal to ``base(x)``.
    ``dropout`` applies to the adapter's input only (training mode). The adapters are
    float32 even when the base weight is bfloat16 or float16: their updates start tiny,
    and in a 16-bit number most of them would round away.
    """

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0) -> None:
        super().__init__()
        check_type("base", base, nn.Linear, "torch.nn.Linear")
        self.r = _check_rank(r, base)
        self.alpha = check_number("alpha", alpha, low=0, low_open=True)
        check_number("dropout", dropout, 0, 1, high_open=True)
        self.scaling = self.alpha / self.r
        self.base = base.requires_grad_(False)
        dtype = torch.promote_types(base.weight.dtype, torch.float32)  # >= float32
        factory = {"device": base.weight.device, "dtype": dtype}
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear's weight
        self.dropout = nn.Dropout(dropout)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def delta_weight(self) -> torch.Tensor:
        """The update the adapter adds to the weight, ``(alpha / r) B A``: (out, in)."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (…, in) -> (…, out), in the base weight's dtype
        h = self.dropout(x.to(self.lora_A.dtype))  # the adapter runs in float32
        update = h @ self.lora_A.T @ self.lora_B.T  # (…, in) -> (…, r) -> (…, out)
        return y + (self.scaling * update).to(y.dtype)

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing the same function: its weight is
        ``W + (alpha / r) B A``, summed in float32, stored in the base's dtype."""
        weight, bias = self.base.weight, self.base.bias
        linear = nn.Linear(self.in_features, self.out_features, bias=bias is not None,
                           device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            delta = self.delta_weight()
            linear.weight.copy_(weight.to(delta.dtype) + delta)
            if bias is not None:
                linear.bias.copy_(bias)
        return linear.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha:g}"


def _check_rank(r: object, base: nn.Linear) -> int:
    """``r`` if it is an int in ``[1, min(in_features, out_features)]`` of ``base``."""
    limit = min(base.in_features, base.out_features)
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= limit:
        raise ValueError(f"r must be an int with 1 <= r <= min(in_features, out_features) = "
                         f"{limit}, got {r!r}")
    return r


def _check_targets(targets: object) -> tuple[str, ...]:
    """``targets`` as a tuple of non-empty layer names, or a clear error."""
    names = () if isinstance(targets, str) or not isinstance(targets, Iterable) else tuple(targets)
    if not names or not all(isinstance(t, str) and t for t in names):
        raise ValueError(f"targets must be a non-empty list of layer names such as "
                         f"{ATTENTION}, got {targets!r}")
    return names


def _target_layers(model: nn.Module, targets: tuple[str, ...], r: int) -> list[str]:
    """The names of the linear layers ``targets`` picks in ``model``, each checked: an
    ``nn.Linear`` with its own weight (not a tied head) and room for rank ``r``."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("model already has LoRA adapters (call merge_lora first to "
                         "fold them in)")
    if any(isinstance(m, CPUMultiHeadAttention) for m in model.modules()):
        raise ValueError("model has CPUMultiHeadAttention layers, whose stacked matmul "
                         "would bypass adapters: build it with cpu_kernels=False for LoRA")
    modules = dict(model.named_modules())
    chosen: dict[str, str] = {}
    for target in targets:
        found = [n for n in modules if n == target or n.endswith("." + target)]
        if not found:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items()
                             if isinstance(m, nn.Linear)})
            raise ValueError(f"target {target!r} matches no layer of the model; its "
                             f"linear layers are named {linear}")
        chosen.update(dict.fromkeys(found, target))
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for name, target in chosen.items():
        module = modules[name]
        if not isinstance(module, nn.Linear):
            raise ValueError(f"target {target!r} matches {name!r}, a "
                             f"{type(module).__name__}, not an nn.Linear")
        if uses[id(module.weight)] > 1:
            raise ValueError(f"{name!r} shares its weight with another module (a tied "
                             f"head?); an adapter there would change both")
        _check_rank(r, module)
    return sorted(chosen)


def apply_lora(model: nn.Module, targets: Iterable[str], r: int = 8,
               alpha: float = 16.0, dropout: float = 0.0) -> list[str]:
    """Wrap every ``nn.Linear`` whose name ends in one of ``targets`` in a
    :class:`LoRALinear` (in place), freeze every other parameter, and return the
    names of the wrapped layers.

    A target is the last part of a module name (``"q_proj"``; see :data:`ATTENTION`,
    :data:`FFN`, :data:`SWIGLU`) or a longer dotted tail (``"blocks.0.attn.q_proj"``).
    A target that matches no linear layer, a match that is not an ``nn.Linear``, a
    layer whose weight is shared with another module (a tied head) or a model that
    already has adapters raises a ValueError, before anything is changed.
    """
    check_number("alpha", alpha, low=0, low_open=True)
    check_number("dropout", dropout, 0, 1, high_open=True)
    names = _target_layers(model, _check_targets(targets), r)
    model.requires_grad_(False)  # freeze every weight ...
    for name in names:  # ... then put a trainable adapter beside each chosen layer
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = LoRALinear(getattr(parent, attr), r=r, alpha=alpha, dropout=dropout)
        setattr(parent, attr, layer)
    return names


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` in ``model`` by the plain ``nn.Linear`` with
    the update folded in (same outputs, no extra cost); returns ``model``. Parameters
    stay frozen. A model without adapters raises a ValueError."""
    wrapped = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not wrapped:
        raise ValueError("model has no LoRA adapters to merge (apply_lora adds them)")
    for name in wrapped:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, getattr(parent, attr).merged())
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors (``…lora_A``, ``…lora_B``) of ``model``: all that a LoRA
    checkpoint stores besides the base model it adapts."""
    return {name: t for name, t in model.state_dict().items()
            if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B")}
