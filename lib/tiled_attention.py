"""Attention one tile at a time, with the online softmax (FlashAttention's idea, in
plain torch).

A softmax seems to need the whole row of scores first, for its maximum and its sum. It
does not: visit the keys in blocks and keep, per query, a running maximum ``m``, a
running sum of exponentials ``l`` and an unnormalised output ``acc``; when a block
raises the maximum, multiply the old ``l`` and ``acc`` by ``exp(m_old - m_new)``. At the
end ``acc / l`` is exactly ``softmax(q k^T / sqrt(D)) v``, and no more than one
``(block_q, block_k)`` tile of scores ever existed. Shapes: H heads, T queries, T_k
keys, D head dimension.
"""
from __future__ import annotations

import math

import torch

from lib.attention import repeat_kv
from lib.checks import check_int

__all__ = ["tiled_attention"]


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    block_q: int = 64, block_k: int = 64,
                    causal: bool = True) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` (causal by default) computed one tile at a time.

    q: ``(..., H, T, D)``; k, v: ``(..., H_kv, T_k, D)`` (grouped-query heads are
    repeated). With ``causal`` the queries are the last ``T`` of the ``T_k`` positions
    (as after a KV cache) and key blocks entirely in a query block's future are never
    visited. Returns ``(..., H, T, D)``.
    """
    _check_inputs(q, k, v, block_q, block_k, causal)
    k, v = repeat_kv(k, q.size(-3)), repeat_kv(v, q.size(-3))   # (..., H, T_k, D)
    T, T_k = q.size(-2), k.size(-2)
    first = T_k - T                                             # position of query 0
    out = torch.empty_like(q)
    for qs in range(0, T, block_q):
        qe = min(qs + block_q, T)
        seen = first + qe if causal else T_k                # keys any of them may see
        positions = torch.arange(first + qs, first + qe, device=q.device)
        out[..., qs:qe, :] = online_softmax_attention(
            q[..., qs:qe, :], k[..., :seen, :], v[..., :seen, :], block_k,
            positions if causal else None)
    return out


def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             block_k: int,
                             q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` for one block of queries, visiting the keys
    ``block_k`` at a time. ``q_positions`` ``(bq,)``: keys at later positions are
    masked (None: no mask)."""
    q = q / math.sqrt(q.size(-1))
    m = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)  # run. max
    l = torch.zeros_like(m)                             # running sum of exp(s - m)
    acc = torch.zeros_like(q)                           # running sum of exp(s - m) * v
    for ks in range(0, k.size(-2), block_k):
        s = q @ k[..., ks:ks + block_k, :].transpose(-2, -1)      # (..., bq, bk) scores
        if q_positions is not None:
            k_positions = torch.arange(ks, ks + s.size(-1), device=q.device)
            s = s.masked_fill(k_positions > q_positions[:, None], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        p = torch.exp(s - m_new[..., None])
        correction = torch.exp(m - m_new)               # rescales the old sums
        l = l * correction + p.sum(dim=-1)
        acc = acc * correction[..., None] + p @ v[..., ks:ks + block_k, :]
        m = m_new
    return acc / l[..., None]


def _check_inputs(q: object, k: object, v: object, block_q: object, block_k: object,
                  causal: object) -> None:
    """TypeError/ValueError unless the arguments of :func:`tiled_attention` fit
    together."""
    check_int("block_q", block_q)
    check_int("block_k", block_k)
    if q.dim() < 3 or q.size(-1) != k.size(-1) or k.shape != v.shape or (
            causal and q.size(-2) > k.size(-2)):
        raise ValueError(f"q must be (..., H, T, D) and k, v (..., H_kv, T_k, D) with "
                         f"the same D (causal: T <= T_k); got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}, v={tuple(v.shape)}")
