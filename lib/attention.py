"""Causal self-attention: the mask, scaled dot-product attention, multi-head attention
and a KV cache.

- :func:`attention_mask`: which keys each query may look at (causal, optionally a
  sliding window with attention sinks); the library's one mask builder.
- :func:`repeat_kv`: grouped-query attention's sharing of key/value heads, written out.
- :func:`scaled_dot_product_attention`: the formula written out (scores, scale, mask,
  softmax, weighted sum), returning the attention weights too. Chapters build it; tests
  hold it against ``F.scaled_dot_product_attention``.
- :func:`fused_attention`: the same formula through torch's fused kernel, which
  :class:`MultiHeadAttention` calls.
- :class:`KVCache`: the keys and values of the tokens generated so far, for one layer.
- :class:`MultiHeadAttention`: projections to heads, optional QK-norm and rotary
  embedding, grouped-query heads (``n_kv_heads < n_heads``), an optional sliding window
  (with sinks).
- :func:`attention_weights`: one layer's attention weights, for plots.

CPU-only speed-ups for the small shapes of chapter 11 live in :mod:`lib.cpu_kernels`.

Shapes: B batch, T queries, T_k keys, C = d_model, H heads, H_kv key/value heads,
D = C / H.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lib.checks import check_bool, check_divisible, check_int, check_number
from lib.norms import RMSNorm

__all__ = ["KVCache", "MultiHeadAttention", "attention_mask", "attention_weights",
           "fused_attention", "repeat_kv", "scaled_dot_product_attention"]

# torch's fused kernel shares key/value heads itself (enable_gqa) from torch 2.5 on.
_SDPA_HAS_GQA = torch.__version__ >= "2.5"


def attention_mask(T_q: int, T_k: int, window: int | None = None,
                   device: torch.device | str | None = None,
                   sinks: int = 0) -> torch.Tensor:
    """Bool mask ``(T_q, T_k)``, True where query i may attend to key j.

    The queries are the *last* ``T_q`` of the ``T_k`` positions (query i sits at
    position ``T_k - T_q + i``), as in cached decoding; ``T_q == T_k`` is the usual
    causal case, a lower triangle. A query sees the keys at its own position and before;
    with ``window=w`` only the ``w`` most recent of them (itself included), plus the
    first ``sinks`` positions of the sequence (attention sinks), however old they are.
    """
    check_int("T_k", T_k, minimum=0)
    check_int("T_q", T_q, minimum=0, maximum=T_k)
    check_int("window", window, optional=True)
    check_int("sinks", sinks, minimum=0)
    q_pos = torch.arange(T_k - T_q, T_k, device=device)[:, None]  # (T_q, 1)
    k_pos = torch.arange(T_k, device=device)[None, :]  # (1, T_k)
    allowed = k_pos <= q_pos  # no peeking at the future
    if window is not None:  # nothing older than the window, except the sinks
        allowed = allowed & ((q_pos - k_pos < window) | (k_pos < sinks))
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
    if q.dim() >= 3:  # grouped-query attention: share k/v heads
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


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None = None, causal: bool = False,
                    dropout_p: float = 0.0) -> torch.Tensor:
    """The output of :func:`scaled_dot_product_attention`, from torch's fused kernel
    ``F.scaled_dot_product_attention``.

    Shapes, ``mask`` and ``dropout_p`` as there; ``causal`` here needs ``T_q == T_k``
    (torch aligns its causal mask with the first key). Grouped-query heads are shared
    inside the kernel (``enable_gqa``, torch >= 2.5), so a decode step does not copy the
    whole KV cache; older torch repeats them first.
    """
    gqa = k.size(-3) != q.size(-3)
    if gqa and not _SDPA_HAS_GQA:  # (B, H_kv, T_k, D) -> (B, H, T_k, D), a copy
        k, v = repeat_kv(k, q.size(-3)), repeat_kv(v, q.size(-3))
    extra = {"enable_gqa": True} if gqa and _SDPA_HAS_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=causal, **extra)


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
    """Causal multi-head self-attention: grouped-query heads, RoPE, a sliding window, a
    KV cache.

    ``n_kv_heads`` (None: ``n_heads``) sets the number of key/value heads: ``n_heads``
    is multi-head attention, 1 is multi-query attention, anything between (dividing
    ``n_heads``) is grouped-query attention. ``rope`` is a module ``rope(x, offset)``
    that rotates ``(B, H, T, D)`` queries and keys (e.g.
    :class:`lib.positional.RotaryEmbedding`). ``window=w`` lets each token see only the
    ``w`` most recent positions, itself included; ``sinks=s`` adds the first ``s``
    positions of the sequence to every window (attention sinks; no effect without a
    window). ``qk_norm=True`` (QK-norm) applies an RMSNorm over the head dimension to
    every query and key head (one gain for queries, one for keys) before RoPE and the
    scores.

    ``forward`` calls torch's fused kernel (:func:`fused_attention`); with ``self.fused
    = False`` it runs :func:`scaled_dot_product_attention`, the formula written out,
    instead.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 rope: nn.Module | None = None, bias: bool = False,
                 dropout: float = 0.0, window: int | None = None, qk_norm: bool = False,
                 sinks: int = 0) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_divisible("d_model", check_int("d_model", d_model),
                        "n_heads", check_int("n_heads", n_heads))
        check_divisible("n_heads", n_heads,
                        "n_kv_heads", check_int("n_kv_heads", n_kv_heads))
        head_dim = d_model // n_heads
        if rope is not None and getattr(rope, "head_dim", head_dim) != head_dim:
            raise ValueError(f"rope.head_dim ({rope.head_dim}) must equal the head "
                             f"dimension d_model / n_heads = {head_dim}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = head_dim
        self.window = check_int("window", window, optional=True)
        self.sinks = check_int("sinks", sinks, minimum=0)
        self.dropout = check_number("dropout", dropout, 0, 1, high_open=True)
        self.fused = True  # False: the written-out formula (to compare the two)
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.rope = rope
        self.qk_norm = check_bool("qk_norm", qk_norm)
        self.q_norm = RMSNorm(head_dim) if qk_norm else None
        self.k_norm = RMSNorm(head_dim) if qk_norm else None
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, offset: int = 0,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """``x`` ``(B, T, C)`` at positions ``offset … offset+T-1`` -> ``(B, T, C)``.

        With a ``kv_cache`` holding the ``offset`` earlier positions, ``x`` holds the
        next ``T`` tokens, whose queries attend to ``T_k = offset + T`` keys; the cache
        grows.
        """
        B, T, C = x.shape
        q, k, v = self.project(x, offset, kv_cache)  # (B, H, T, D), k and v (B, H_kv, T_k, D)
        mask, causal = self.mask(T, k.size(2), x.device)
        p = self.dropout if self.training else 0.0
        if self.fused:  # torch's kernel
            y = fused_attention(q, k, v, mask=mask, causal=causal, dropout_p=p)
        else:  # the same formula, written out
            y, _ = scaled_dot_product_attention(q, k, v, mask=mask, causal=causal,
                                                dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, C)  # heads side by side: (B, T, C)
        return self.resid_dropout(self.out_proj(y))

    def project(self, x: torch.Tensor, offset: int = 0, kv_cache: KVCache | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, H, T, D)`` and keys, values ``(B, H_kv, T_k, D)`` for ``x``
        ``(B, T, C)`` at positions ``offset …``: projected, split into heads, QK-normed
        and rotated, the cache's earlier keys and values in front (the cache grows)."""
        B, T, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)
        k = self.k_proj(x).view(B, T, H_kv, D).transpose(1, 2)  # (B, H_kv, T, D)
        v = self.v_proj(x).view(B, T, H_kv, D).transpose(1, 2)  # (B, H_kv, T, D)
        if self.qk_norm:  # each head's queries and keys rescaled to RMS 1, times a gain
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, H_kv, T_k, D), T_k = offset + T
        return q, k, v

    def mask(self, T: int, T_k: int, device: torch.device | str | None = None
             ) -> tuple[torch.Tensor | None, bool]:
        """``(mask, causal)`` for ``T`` queries, the last of ``T_k`` positions. Without
        a window the kernels need no mask tensor: ``(None, True)`` when ``T == T_k``
        (the causal case) and ``(None, False)`` for one new token, which sees every key;
        with a window, the :func:`attention_mask`."""
        if self.window is None and T in (1, T_k):
            return None, T == T_k
        mask = attention_mask(T, T_k, self.window, device=device, sinks=self.sinks)
        return mask, False

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, window={self.window}, sinks={self.sinks}, "
                f"qk_norm={self.qk_norm}, fused={self.fused}")


def attention_weights(attn: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The attention weights ``(B, H, T, T)`` of layer ``attn`` on ``x`` ``(B, T, C)``,
    from the written-out formula: each row sums to 1, zero where the mask hides a key.
    For plots."""
    q, k, v = attn.project(x)
    mask, causal = attn.mask(x.size(1), x.size(1), x.device)
    _, weights = scaled_dot_product_attention(q, k, v, mask=mask, causal=causal)
    return weights
