"""CPU-only speed-ups for the small shapes of the CPU profile: opt-in, measured, tested.

On a CPU, at the tiny model's sizes (a few heads of 32 dimensions, sequences of 64 to
128 positions), torch's general kernels leave time on the table. Three choices recover
it, each measured against its alternative by ``benchmarks/cpu_kernels.py`` and checked
by ``tests/test_cpu_kernels.py`` to compute what the written-out path computes:

- causal attention as ``baddbmm`` + softmax + ``bmm`` (:func:`causal_attention_bmm`),
  which beats ``F.scaled_dot_product_attention`` up to about :data:`BMM_MAX_POSITIONS`
  positions (the longest context ``cpu_kernels`` accepts);
- queries, keys and values from one matmul with the three weight matrices stacked, and
  queries and keys rotated by RoPE in one call;
- torch's fused AdamW kernel, a training setting: ``TrainConfig(fused_adamw=True)``,
  which :func:`lib.profiles.cpu_profile` sets.

The first two live in :class:`CPUMultiHeadAttention`, which a model uses in place of
:class:`lib.attention.MultiHeadAttention` when its config says so
(``GPTConfig(cpu_kernels=True)``, which :func:`lib.profiles.cpu_profile` sets): same
parameters, same results up to rounding. Nothing a chapter shows depends on this module;
the tiny model of :mod:`lib.tiny_model` does not use it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lib.attention import KVCache, MultiHeadAttention, attention_mask, repeat_kv

__all__ = ["BMM_MAX_POSITIONS", "CPUMultiHeadAttention", "causal_attention_bmm"]

# Up to this many positions causal_attention_bmm is faster on a CPU than torch's fused
# kernel (benchmarks/cpu_kernels.py); GPTConfig refuses cpu_kernels for longer contexts.
BMM_MAX_POSITIONS = 128


def causal_attention_bmm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention for queries ``(B, H, T, D)`` that are the last ``T`` of the
    ``T_k`` positions of keys and values ``(B, H, T_k, D)``, in three batched kernels.

    The formula of :func:`lib.attention.scaled_dot_product_attention` with the mask of
    :func:`lib.attention.attention_mask`: the scores, their scaling and the mask
    (``-inf`` on future keys, added) are one ``baddbmm``, then the softmax, then the
    weighted sum, one ``bmm``.
    """
    B, H, T, D = q.shape
    T_k = k.size(2)
    future = torch.zeros(T, T_k, device=q.device, dtype=q.dtype).masked_fill(
        ~attention_mask(T, T_k, device=q.device), float("-inf"))  # (T, T_k): 0 or -inf
    scores = torch.baddbmm(future, q.reshape(B * H, T, D),
                           k.reshape(B * H, T_k, D).transpose(1, 2),
                           alpha=1 / math.sqrt(D))  # (B*H, T, T_k): q k^T / sqrt(D) + M
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.bmm(weights, v.reshape(B * H, T_k, D)).view(B, H, T, D)


class CPUMultiHeadAttention(MultiHeadAttention):
    """:class:`lib.attention.MultiHeadAttention` (causal, no window) computed for a CPU:
    q, k and v from one matmul with the three weight matrices stacked, queries and keys
    rotated in one call, :func:`causal_attention_bmm`; a KV cache works as in the parent,
    and a left-padded batch (``n_pad``) takes the parent's path.

    One path, fixed at construction: :class:`lib.config.GPTConfig` refuses
    ``cpu_kernels=True`` with a ``window`` or with a ``context_length`` above
    :data:`BMM_MAX_POSITIONS` (where torch's fused kernel is faster). The stacked matmul
    reads the projections' weights without calling them, so a forward hook on
    ``q_proj``/``k_proj``/``v_proj`` does not run and :func:`lib.lora.apply_lora`
    refuses these projections (build the model with ``cpu_kernels=False`` for LoRA)."""

    def forward(self, x: torch.Tensor, offset: int = 0, kv_cache: KVCache | None = None,
                n_pad: torch.Tensor | None = None) -> torch.Tensor:
        if n_pad is not None:  # left-padded rows need the padding mask: the parent's path
            return super().forward(x, offset, kv_cache, n_pad)
        B, T, C = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        proj = (self.q_proj, self.k_proj, self.v_proj)
        w = torch.cat([m.weight for m in proj])  # (C + 2 H_kv D, C): stacked
        b = None if self.q_proj.bias is None else torch.cat([m.bias for m in proj])
        qkv = F.linear(x, w, b).view(B, T, H + 2 * H_kv, D).transpose(1, 2)
        qk, v = qkv.split([H + H_kv, H_kv], dim=1)  # (B, H + H_kv, T, D), v
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        if self.rope is not None:
            qk = self.rope(qk, offset)  # queries and keys rotated in one call
        q, k = qk.split([H, H_kv], dim=1)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, H_kv, T_k, D), T_k = offset + T
        k, v = repeat_kv(k, H), repeat_kv(v, H)  # (B, H, T_k, D)
        p = self.dropout if self.training else 0.0
        y = causal_attention_bmm(q, k, v, dropout_p=p)  # (B, H, T, D)
        return self.resid_dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, C)))
