"""Causal self-attention: the mask, scaled dot-product attention, multi-head attention
and a KV cache.

- :func:`attention_mask`: which keys each query may look at (causal, optionally a
  sliding window with attention sinks, and left-padded rows); the library's one mask
  builder.
- :func:`repeat_kv`: grouped-query attention's sharing of key/value heads, written out.
- :func:`scaled_dot_product_attention`: the formula written out (scores, scale, mask,
  softmax, weighted sum), returning the attention weights too. Chapters build it; tests
  hold it against ``F.scaled_dot_product_attention``, torch's kernel, which
  :class:`MultiHeadAttention` calls.
- :class:`KVCache`: the keys and values of the tokens generated so far, for one layer.
- :class:`MultiHeadAttention`: projections to heads, optional QK-norm and rotary
  embedding, grouped-query heads (``n_kv_heads < n_heads``), an optional sliding window
  (with sinks).
- :func:`attention_weights`: one layer's attention weights from the written-out formula,
  for plots.

A CPU-only speed-up for the small shapes of chapter 11 lives in :mod:`lib.cpu_kernels`
(``GPTConfig(cpu_kernels=True)``).

Shapes: B batch, T queries, T_k keys, C = d_model, H heads, H_kv key/value heads,
D = C / H.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lib.norms import RMSNorm

__all__ = ["KVCache", "MultiHeadAttention", "attention_mask", "attention_weights",
           "repeat_kv", "scaled_dot_product_attention"]


def attention_mask(T_q: int, T_k: int, window: int | None = None, sinks: int = 0,
                   device: torch.device | str | None = None,
                   n_pad: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask ``(T_q, T_k)``, True where query i may attend to key j.

    The queries are the *last* ``T_q`` of the ``T_k`` positions (query i sits at
    position ``T_k - T_q + i``), as in cached decoding; ``T_q == T_k`` is the usual
    causal case, a lower triangle. A query sees the keys at its own position and before;
    with ``window=w`` only the ``w`` most recent of them (itself included), plus the
    first ``sinks`` positions of the sequence (attention sinks), however old they are.

    ``n_pad`` ``(B,)``: row b of a batch opens with ``n_pad[b]`` padding tokens (left
    padding), so its positions count from index ``n_pad[b]`` and the mask is ``(B, 1,
    T_q, T_k)``, one per row, the same for every head. No query sees padding; a padding
    query sees only itself, so that no row of scores is all ``-inf``.
    """
    q_pos = torch.arange(T_k - T_q, T_k, device=device)[:, None]  # (T_q, 1)
    k_pos = torch.arange(T_k, device=device)[None, :]  # (1, T_k)
    if n_pad is not None:  # each row's own positions: (B, 1, T_q, 1), (B, 1, 1, T_k)
        q_pos, k_pos = q_pos - n_pad.view(-1, 1, 1, 1), k_pos - n_pad.view(-1, 1, 1, 1)
    allowed = k_pos <= q_pos  # no peeking at the future
    if window is not None:  # nothing older than the window, except the sinks
        allowed = allowed & ((q_pos - k_pos < window) | (k_pos < sinks))
    if n_pad is not None:  # padding sits at positions < 0: hidden, but from itself
        allowed = (allowed & (k_pos >= 0)) | (k_pos == q_pos)
    return allowed


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Grouped-query attention: repeat each of the ``H_kv`` key (or value) heads so that
    ``n_heads`` query heads each find theirs, ``(..., H_kv, T, D) -> (..., n_heads, T,
    D)``.

    Query head ``h`` reads key/value head ``h // (n_heads / H_kv)``: consecutive query
    heads share one.
    """
    H_kv = x.size(-3)
    return x if H_kv == n_heads else x.repeat_interleave(n_heads // H_kv, dim=-3)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: torch.Tensor | None = None, causal: bool = False,
                                 dropout_p: float = 0.0
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T / sqrt(D) + mask) v``, written out. Returns ``(output,
    weights)``.

    q: ``(..., H, T_q, D)``; k, v: ``(..., H_kv, T_k, D)``. When ``H_kv < H``
    (grouped-query attention) each key/value head serves ``H / H_kv`` consecutive query
    heads. mask: bool, broadcastable to ``(..., H, T_q, T_k)``, True = may attend.
    causal: also hide future keys, aligning the last query with the last key (query i
    sees keys ``j <= i + T_k - T_q``), as cached decoding needs. dropout_p: dropout on
    the weights before they mix the values (training only; the returned weights are the
    ones before dropout). output: ``(..., H, T_q, D)``; weights: ``(..., H, T_q, T_k)``,
    each row sums to 1.
    """
    if q.dim() >= 3:  # with a heads axis: repeat k/v heads if grouped, else a no-op
        k, v = repeat_kv(k, q.size(-3)), repeat_kv(v, q.size(-3))  # (..., H, T_k, D)
    T_q, T_k = q.size(-2), k.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., T_q, T_k)
    if causal:
        future = ~attention_mask(T_q, T_k, device=q.device)
        scores = scores.masked_fill(future, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (..., T_q, T_k)
    mixing = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return mixing @ v, weights  # (..., T_q, D), (..., T_q, T_k)


class KVCache:
    """Keys and values of every token processed so far, for one attention layer.

    During generation each new token only needs its own query; its keys and values join
    the cache, so earlier tokens are never recomputed. Stored after the rotary
    embedding, with the ``H_kv`` key/value heads (not repeated per query head): ``(B,
    H_kv, T_cached, D)``.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Number of cached positions."""
        return 0 if self.k is None else self.k.size(2)

    def update(self, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H_kv, T, D)`` keys and values; return all of them,
        ``(B, H_kv, T_cached, D)``."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def reset(self) -> None:
        """Forget everything (start a new sequence)."""
        self.k = self.v = None

    def __repr__(self) -> str:
        return f"KVCache(length={self.length})"


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention through ``F.scaled_dot_product_attention``.

    ``n_kv_heads`` (None: ``n_heads``): 1 is multi-query attention, a divisor of
    ``n_heads`` grouped-query attention. ``rope(x, offset)`` rotates queries and keys
    (:class:`lib.positional.RotaryEmbedding`). ``window=w``: each token sees the ``w``
    latest positions (itself included) and the first ``sinks`` (attention sinks).
    ``qk_norm``: an RMSNorm over each query and key head before RoPE."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 rope: nn.Module | None = None, bias: bool = False, dropout: float = 0,
                 window: int | None = None, sinks: int = 0, qk_norm: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.head_dim = D = d_model // n_heads
        self.window, self.sinks, self.dropout, self.rope = window, sinks, dropout, rope
        self.q_proj = nn.Linear(d_model, n_heads * D, bias=bias)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * D, bias=bias)
        self.out_proj = nn.Linear(n_heads * D, d_model, bias=bias)
        self.q_norm, self.k_norm = (RMSNorm(D), RMSNorm(D)) if qk_norm else (None, None)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, offset: int = 0, kv_cache: KVCache | None = None,
                n_pad: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(B, T, C)`` at positions ``offset …`` -> ``(B, T, C)``; a
        ``kv_cache`` holds earlier keys and values; ``n_pad`` ``(B,)``: left padding."""
        B, T, C = x.shape
        q, k, v = self.project(x, offset, kv_cache, n_pad)  # (B,H,T,D), (B,H_kv,T_k,D)
        mask, causal = self.mask(T, k.size(2), x.device, n_pad)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal, enable_gqa=self.n_kv_heads != self.n_heads)  # (B,H,T,D)
        y = y.transpose(1, 2).reshape(B, T, C)  # heads side by side: (B, T, C)
        return self.resid_dropout(self.out_proj(y))

    def project(self, x: torch.Tensor, offset: int = 0, kv_cache: KVCache | None = None,
                n_pad: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Queries ``(B, H, T, D)``, keys and values ``(B, H_kv, T_k, D)`` for ``x``:
        projected, split into heads, QK-normed, rotated, after the cache's."""
        B, T, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)
        k = self.k_proj(x).view(B, T, H_kv, D).transpose(1, 2)  # (B, H_kv, T, D)
        v = self.v_proj(x).view(B, T, H_kv, D).transpose(1, 2)  # (B, H_kv, T, D)
        if self.q_norm is not None:  # each head's queries and keys: RMS 1, times a gain
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, offset, n_pad), self.rope(k, offset, n_pad)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, H_kv, T_k, D), T_k = offset + T
        return q, k, v

    def mask(self, T: int, T_k: int, device: torch.device | str | None = None,
             n_pad: torch.Tensor | None = None) -> tuple[torch.Tensor | None, bool]:
        """``(mask, causal)`` for the last ``T`` of ``T_k`` positions: with no window or
        padding, none if all are new (causal) or one is; else :func:`attention_mask`."""
        if self.window is None and n_pad is None and T in (1, T_k):
            return None, T == T_k
        return attention_mask(T, T_k, self.window, self.sinks, device, n_pad), False


def attention_weights(attn: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The attention weights ``(B, H, T, T)`` of layer ``attn`` on ``x`` ``(B, T, C)``,
    from the written-out formula: each row sums to 1, zero where the mask hides a key.
    For plots."""
    q, k, v = attn.project(x)
    mask, causal = attn.mask(x.size(1), x.size(1), x.device)
    _, weights = scaled_dot_product_attention(q, k, v, mask=mask, causal=causal)
    return weights
