"""Causal self-attention: masks, scaled dot-product attention, multi-head attention with a KV cache.

- :func:`attention_mask` (and its everyday case :func:`causal_mask`): which keys each query may
  look at.
- :func:`repeat_kv`: grouped-query attention's sharing of key/value heads.
- :func:`scaled_dot_product_attention`: the formula written out (scores, scale, mask, softmax,
  weighted sum); returns the attention weights too, for plots.
- :class:`KVCache`: the keys and values of the tokens generated so far, for one layer.
- :class:`MultiHeadAttention`: projections to heads, optional rotary embedding, grouped-query heads
  (``n_kv_heads < n_heads``), an optional sliding window (with attention sinks), and a fast path
  through ``torch.nn.functional.scaled_dot_product_attention`` when the weights are not needed.

Shapes: B batch, T queries, T_k keys, C = d_model, H heads, H_kv key/value heads, D = C / H.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lib.checks import check_bool, check_divisible, check_int, check_number
from lib.norms import RMSNorm


def attention_mask(T_q: int, T_k: int, window: int | None = None,
                   device: torch.device | str | None = None, sinks: int = 0) -> torch.Tensor:
    """Bool mask ``(T_q, T_k)``, True where query i may attend to key j.

    The queries are the *last* ``T_q`` of the ``T_k`` positions (query i sits at position
    ``T_k - T_q + i``), which is the situation of cached decoding; ``T_q == T_k`` is the usual
    causal case. A query sees the keys at its own position and before; with ``window=w`` only the
    ``w`` most recent of them (itself included), plus the first ``sinks`` positions of the
    sequence (attention sinks, StreamingLLM), which stay visible however old they are.
    """
    check_int("T_k", T_k, minimum=0)
    check_int("T_q", T_q, minimum=0, maximum=T_k)
    check_int("window", window, optional=True)
    check_int("sinks", sinks, minimum=0)
    q_pos = torch.arange(T_k - T_q, T_k, device=device)[:, None]  # (T_q, 1)
    k_pos = torch.arange(T_k, device=device)[None, :]  # (1, T_k)
    allowed = k_pos <= q_pos  # no peeking at the future
    if window is not None:
        recent_or_sink = (q_pos - k_pos < window) | (k_pos < sinks)
        allowed = allowed & recent_or_sink  # nothing older than the window, except the sinks
    return allowed


def causal_mask(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool lower-triangular mask ``(T, T)``: True where key j <= query i (attending is allowed).

    The everyday case of :func:`attention_mask`: as many queries as keys, no window.
    """
    check_int("T", T, minimum=0)
    return attention_mask(T, T, device=device)


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Grouped-query attention: repeat each of the ``H_kv`` key (or value) heads so that ``n_heads``
    query heads each find theirs, ``(..., H_kv, T, D) -> (..., n_heads, T, D)``.

    Head ``h`` reads key/value head ``h // (n_heads / H_kv)``: consecutive query heads share one.
    """
    H_kv = x.size(-3)
    if n_heads % H_kv:
        raise ValueError(f"the number of query heads ({n_heads}) must be a multiple of "
                         f"key/value heads ({H_kv})")
    return x if H_kv == n_heads else x.repeat_interleave(n_heads // H_kv, dim=-3)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: torch.Tensor | None = None, causal: bool = False,
                                 dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T / sqrt(D) + mask) v``, written out. Returns ``(output, weights)``.

    q: ``(..., H, T_q, D)``; k, v: ``(..., H_kv, T_k, D)``. When ``H_kv < H`` (grouped-query
    attention) each key/value head serves ``H / H_kv`` consecutive query heads.
    mask: bool, broadcastable to ``(..., H, T_q, T_k)``, True = may attend.
    causal: also hide future keys, aligning the last query with the last key (query i sees keys
    ``j <= i + T_k - T_q``), as cached decoding needs.
    dropout_p: dropout on the weights before they mix the values (training only; the returned
    weights are the ones before dropout).
    output: ``(..., H, T_q, D)``; weights: ``(..., H, T_q, T_k)``, each row sums to 1.
    """
    if q.size(-1) != k.size(-1) or k.shape != v.shape:
        raise ValueError(f"q, k, v must share the last dimension and k, v their whole shape; got shapes "
                         f"q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}")
    if q.dim() >= 3:  # grouped-query attention: share k/v heads
        k, v = repeat_kv(k, q.size(-3)), repeat_kv(v, q.size(-3))  # (..., H, T_k, D)
    T_q, T_k = q.size(-2), k.size(-2)
    if causal and T_q > T_k:
        raise ValueError(f"causal=True needs at most as many queries as keys, got T_q={T_q}, T_k={T_k}")
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., T_q, T_k)
    if causal:
        scores = scores.masked_fill(~attention_mask(T_q, T_k, device=q.device), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (..., T_q, T_k)
    mixing = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return mixing @ v, weights  # (..., T_q, D), (..., T_q, T_k)


# Up to this many positions, MultiHeadAttention on a CPU uses causal_attention_bmm rather than
# torch's fused kernel, which is slower for short sequences (benchmarks/cpu_kernels.py).
SHORT_SEQUENCE = 128


def causal_attention_bmm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention ``(B, H, T, D)`` for q, k, v of one shape, in three batched kernels.

    The same formula as :func:`scaled_dot_product_attention` with ``causal=True``: the scores,
    their scaling and the mask (``-inf`` above the diagonal, added) are one ``baddbmm``, then
    softmax, then the weighted sum. On a CPU this beats ``F.scaled_dot_product_attention`` for
    sequences of up to about ``SHORT_SEQUENCE`` positions, which is what a small model trains on.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have one shape (B, H, T, D); got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}, v={tuple(v.shape)}")
    B, H, T, D = q.shape
    future = torch.full((T, T), float("-inf"), device=q.device, dtype=q.dtype).triu(1)  # (T, T)
    scores = torch.baddbmm(future, q.reshape(B * H, T, D), k.reshape(B * H, T, D).transpose(1, 2),
                           alpha=1 / math.sqrt(D))  # (B*H, T, T): q k^T / sqrt(D), future -inf
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.bmm(weights, v.reshape(B * H, T, D)).view(B, H, T, D)


class KVCache:
    """Keys and values of every token processed so far, for one attention layer.

    During generation each new token only needs its own query; its keys and values join the
    cache, so earlier tokens are never recomputed. Stored after the rotary embedding, with the
    ``H_kv`` key/value heads (not repeated per query head): ``(B, H_kv, T_cached, D)``.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Number of cached positions."""
        return 0 if self.k is None else self.k.size(2)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H_kv, T, D)`` keys and values; return all of them, ``(B, H_kv, T_cached, D)``."""
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
    """Causal multi-head self-attention with grouped-query heads, RoPE, a sliding window, a KV cache.

    ``n_kv_heads`` (default ``n_heads``) sets the number of key/value heads: ``n_heads`` is
    multi-head attention, 1 is multi-query attention, anything between (dividing ``n_heads``) is
    grouped-query attention. ``rope`` is a module ``rope(x, offset)`` that rotates ``(B, H, T, D)``
    queries and keys (e.g. :class:`lib.positional.RotaryEmbedding`). ``window=w`` lets each token see
    only the ``w`` most recent positions, itself included; ``sinks=s`` adds the first ``s``
    positions of the sequence to every window (attention sinks; no effect without a window).
    ``qk_norm=True`` (QK-norm) applies an
    RMSNorm over the head dimension to every query and key head (gains shared across heads, one
    for queries and one for keys) before RoPE and the scores, which bounds the size of the scores.

    ``forward`` with ``self.fast`` (the default) computes q, k and v with one matmul and uses
    ``F.scaled_dot_product_attention`` (fused kernels), or :func:`causal_attention_bmm` for short
    sequences on a CPU; ``self.fast = False`` runs the three projections one by one and
    :func:`scaled_dot_product_attention`, the formula written out, which also returns the weights.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 rope: nn.Module | None = None, bias: bool = False, dropout: float = 0.0,
                 window: int | None = None, qk_norm: bool = False, sinks: int = 0) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_divisible("d_model", check_int("d_model", d_model), "n_heads", check_int("n_heads", n_heads))
        check_divisible("n_heads", n_heads, "n_kv_heads", check_int("n_kv_heads", n_kv_heads))
        head_dim = d_model // n_heads
        if rope is not None and getattr(rope, "head_dim", head_dim) != head_dim:
            raise ValueError(f"rope.head_dim ({rope.head_dim}) must equal the head dimension "
                             f"d_model / n_heads = {head_dim}")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.window = check_int("window", window, optional=True)
        self.sinks = check_int("sinks", sinks, minimum=0)
        self.dropout = check_number("dropout", dropout, 0, 1, high_open=True)
        self.fast = True  # False forces the explicit path (used to compare the two)
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.rope = rope
        self.qk_norm = check_bool("qk_norm", qk_norm)
        self.q_norm = RMSNorm(head_dim) if qk_norm else None
        self.k_norm = RMSNorm(head_dim) if qk_norm else None
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None,
                need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``(B, T, C)`` -> ``(out (B, T, C), weights (B, H, T, T_k) or None)``.

        With a ``kv_cache`` holding ``T_cached`` earlier positions, ``x`` holds the next ``T`` tokens
        and ``T_k = T_cached + T``; the cache is extended in place.
        """
        if x.dim() != 3 or x.size(-1) != self.d_model:
            raise ValueError(f"x must have shape (B, T, d_model={self.d_model}), got {tuple(x.shape)}")
        B, T, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        offset = 0 if kv_cache is None else kv_cache.length  # position of x's first token
        explicit = need_weights or not self.fast  # the written-out path, which returns the weights
        qkv = self._qkv(x, stacked=not explicit)  # (B, H + 2 H_kv, T, D): queries, keys, values
        qk, v = qkv.split([H + H_kv, H_kv], dim=1)  # (B, H + H_kv, T, D), (B, H_kv, T, D)
        if self.qk_norm:  # each head's query and key vectors rescaled to RMS 1 (times a gain)
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        if self.rope is not None:
            qk = self.rope(qk, offset)  # queries and keys rotated in one call
        q, k = qk.split([H, H_kv], dim=1)  # (B, H, T, D), (B, H_kv, T, D)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, H_kv, T_k, D), T_k = offset + T
        T_k = k.size(2)
        k, v = repeat_kv(k, H), repeat_kv(v, H)  # (B, H_kv, T_k, D) -> (B, H, T_k, D)
        p = self.dropout if self.training else 0.0
        if explicit:
            mask = attention_mask(T, T_k, self.window, device=x.device, sinks=self.sinks)  # (T, T_k)
            y, weights = scaled_dot_product_attention(q, k, v, mask=mask, dropout_p=p)
        else:
            weights = None
            if self.window is None and T == T_k and x.device.type == "cpu" and T <= SHORT_SEQUENCE:
                y = causal_attention_bmm(q, k, v, dropout_p=p)  # faster than the fused kernel here
            elif self.window is None and T == T_k:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            elif self.window is None and T == 1:  # one new token: every cached key is in its past
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
            else:
                mask = attention_mask(T, T_k, self.window, device=x.device, sinks=self.sinks)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, H, T, D) -> (B, T, C): heads side by side
        return self.resid_dropout(self.out_proj(y)), (weights if need_weights else None)

    def _qkv(self, x: torch.Tensor, stacked: bool) -> torch.Tensor:
        """Queries, keys and values side by side, one head per row: ``(B, T, C) -> (B, H + 2 H_kv,
        T, D)``. With ``stacked`` that is chapter 6's fused projection, one matmul with the three
        weight matrices stacked (when :meth:`_stackable`), otherwise the three projections."""
        B, T, _ = x.shape
        if stacked and self._stackable():
            w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            b = (None if self.q_proj.bias is None else
                 torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
            y = F.linear(x, w, b)  # (B, T, (H + 2 H_kv) D)
        else:
            y = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return y.view(B, T, -1, self.head_dim).transpose(1, 2)

    def _stackable(self) -> bool:
        """True when q, k and v can come from one matmul: all three projections are plain
        ``nn.Linear`` layers (not, e.g., LoRA-wrapped) without forward hooks, which one stacked
        matmul would bypass."""
        return all(type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks
                   for m in (self.q_proj, self.k_proj, self.v_proj))

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"window={self.window}, sinks={self.sinks}, qk_norm={self.qk_norm}, fast={self.fast}")
