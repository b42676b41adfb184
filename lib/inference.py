"""Serving a trained model cheaply: tiled attention, a quantised KV cache, speculative decoding.

- :func:`tiled_attention`: causal attention computed block by block with the online softmax
  (FlashAttention's idea, in plain torch): never holds more than one ``(block_q, block_k)`` tile
  of scores, and equals ``softmax(q k^T / sqrt(D)) v``.
- :func:`quantize_int8` / :func:`dequantize_int8` and :class:`QuantizedKVCache`: keys and values
  kept as int8 with one float scale per head and position, a drop-in for
  :class:`lib.attention.KVCache`.
- :func:`speculative_decode`: a small draft model proposes ``k`` tokens, the target model checks
  them all in one forward pass; greedy (the target's own greedy output, exactly) or sampled (the
  target's distribution, exactly, through :func:`speculative_accept`).
- :func:`set_window`: switch every attention layer of a model to a sliding window with attention
  sinks (or back to full attention).

Shapes: B batch, H heads, T queries, T_k keys, D head dimension, V vocabulary.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lib.attention import KVCache, MultiHeadAttention, repeat_kv
from lib.checks import check_bool, check_int, check_number, check_type


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = 64,
                    block_k: int = 64, causal: bool = True) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` (causal by default) computed one tile at a time.

    q: ``(..., H, T, D)``; k, v: ``(..., H_kv, T_k, D)`` (grouped-query heads are repeated).
    For each block of ``block_q`` queries the key blocks are visited in order, keeping per query a
    running maximum ``m``, a running sum of exponentials ``l`` and an unnormalised output ``acc``;
    when a block raises the maximum, the old ``l`` and ``acc`` are multiplied by ``exp(m_old -
    m_new)``. The output is ``acc / l``. With ``causal`` the queries are the last ``T`` of the
    ``T_k`` positions, as in :func:`lib.attention.attention_mask`, and key blocks entirely in a
    query block's future are skipped. Returns ``(..., H, T, D)``.
    """
    check_type("q", q, torch.Tensor)
    check_type("k", k, torch.Tensor)
    check_type("v", v, torch.Tensor)
    if q.dim() < 3 or q.size(-1) != k.size(-1) or k.shape != v.shape:
        raise ValueError(f"q must be (..., H, T, D) and k, v (..., H_kv, T_k, D) with the same D; got "
                         f"q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}")
    check_int("block_q", block_q)
    check_int("block_k", block_k)
    check_bool("causal", causal)
    k, v = repeat_kv(k, q.size(-3)), repeat_kv(v, q.size(-3))  # (..., H, T_k, D)
    T, T_k, D = q.size(-2), k.size(-2), q.size(-1)
    if causal and T > T_k:
        raise ValueError(f"causal=True needs at most as many queries as keys, got T={T}, T_k={T_k}")
    scale = 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    first = T_k - T  # position of query 0
    for qs in range(0, T, block_q):
        qe = min(qs + block_q, T)
        qb = q[..., qs:qe, :] * scale                                    # (..., bq, D)
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # (..., bq)
        l = torch.zeros_like(m)                                           # (..., bq)
        acc = torch.zeros_like(qb)                                        # (..., bq, D)
        last_key = first + qe - 1 if causal else T_k - 1                  # newest key any query sees
        for ks in range(0, last_key + 1, block_k):
            ke = min(ks + block_k, T_k)
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)                   # (..., bq, bk) scores
            if causal and ke - 1 > first + qs:                            # the tile crosses the diagonal
                q_pos = torch.arange(first + qs, first + qe, device=q.device)[:, None]
                k_pos = torch.arange(ks, ke, device=q.device)[None, :]
                s = s.masked_fill(k_pos > q_pos, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))                      # (..., bq)
            p = torch.exp(s - m_new[..., None])                           # (..., bq, bk)
            correction = torch.exp(m - m_new)                             # rescales the old sums
            l = l * correction + p.sum(dim=-1)
            acc = acc * correction[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None]
    return out


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last dimension: ``x ≈ q * scale``.

    Returns ``(q, scale)``: ``q`` int8 with the shape of ``x``, ``scale`` float32 with the last
    dimension 1 (``max |x| / 127`` of each row; rows of zeros get scale 1). The rounding error of
    each entry is at most ``scale / 2``.
    """
    check_type("x", x, torch.Tensor)
    if not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"x must be a floating-point tensor with at least one dimension, got dtype "
                         f"{x.dtype} and shape {tuple(x.shape)}")
    absmax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``: the inverse of :func:`quantize_int8` up to its rounding."""
    check_type("q", q, torch.Tensor)
    check_type("scale", scale, torch.Tensor)
    if q.dtype != torch.int8:
        raise ValueError(f"q must be an int8 tensor, got dtype {q.dtype}")
    return (q.float() * scale).to(dtype)


class QuantizedKVCache(KVCache):
    """A :class:`lib.attention.KVCache` that stores keys and values as int8.

    Each key (and value) vector of one head at one position, ``D`` numbers, is kept as ``D`` int8
    values and one float32 scale (:func:`quantize_int8`): ``D + 4`` bytes instead of ``4 D``.
    ``update`` returns the dequantised keys and values of every cached position, so attention runs
    in floating point as usual; only what is stored between steps is smaller.
    """

    def __init__(self) -> None:
        super().__init__()
        self._parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._dtype = torch.float32

    @property
    def length(self) -> int:
        """Number of cached positions."""
        return 0 if not self._parts else self._parts["k"][0].size(2)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise and append ``(B, H_kv, T, D)`` keys and values; return all of them dequantised."""
        self._dtype = k.dtype
        for name, x in (("k", k), ("v", v)):
            q, scale = quantize_int8(x)
            if name in self._parts:
                old_q, old_scale = self._parts[name]
                q, scale = torch.cat([old_q, q], dim=2), torch.cat([old_scale, scale], dim=2)
            self._parts[name] = (q, scale)
        return tuple(dequantize_int8(*self._parts[n], dtype=self._dtype) for n in ("k", "v"))

    @property
    def k(self) -> torch.Tensor | None:  # type: ignore[override]
        """The cached keys, dequantised (None when empty)."""
        return dequantize_int8(*self._parts["k"], dtype=self._dtype) if self._parts else None

    @k.setter
    def k(self, value: Any) -> None:  # the base class's reset and __init__ assign None
        if value is not None:
            raise ValueError("QuantizedKVCache keys are set through update(), not assigned")
        self._parts = {}

    @property
    def v(self) -> torch.Tensor | None:  # type: ignore[override]
        """The cached values, dequantised (None when empty)."""
        return dequantize_int8(*self._parts["v"], dtype=self._dtype) if self._parts else None

    @v.setter
    def v(self, value: Any) -> None:
        if value is not None:
            raise ValueError("QuantizedKVCache values are set through update(), not assigned")
        self._parts = {}

    def nbytes(self) -> int:
        """Bytes stored: the int8 keys and values plus their float32 scales."""
        return sum(q.numel() * q.element_size() + s.numel() * s.element_size()
                   for q, s in self._parts.values())

    def __repr__(self) -> str:
        return f"QuantizedKVCache(length={self.length}, nbytes={self.nbytes()})"


def set_window(model: nn.Module, window: int | None, sinks: int = 0) -> int:
    """Give every :class:`lib.attention.MultiHeadAttention` in ``model`` a sliding ``window`` of
    that many recent positions plus ``sinks`` attention sinks (the first positions of the sequence);
    ``window=None`` restores full causal attention (``sinks`` must then be 0). Returns the number of
    attention layers changed."""
    check_type("model", model, nn.Module, "torch.nn.Module")
    check_int("window", window, optional=True)
    check_int("sinks", sinks, minimum=0)
    if window is None and sinks:
        raise ValueError(f"sinks={sinks} needs a window (sinks only matter when old positions are hidden)")
    n = 0
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.window, module.sinks = window, sinks
            n += 1
    return n


def speculative_accept(p: torch.Tensor, q: torch.Tensor, token: int,
                       generator: torch.Generator | None = None) -> tuple[bool, int]:
    """The rejection rule of speculative sampling for one proposed token.

    ``p`` and ``q`` are the target's and the draft's next-token distributions ``(V,)``; ``token``
    was drawn from ``q``. It is kept with probability ``min(1, p[token] / q[token])``; otherwise a
    replacement is drawn from the residual ``max(p - q, 0)`` (renormalised). Returns
    ``(accepted, token_out)``. Whatever ``q`` is, ``token_out`` is distributed as ``p``.
    """
    check_type("p", p, torch.Tensor)
    check_type("q", q, torch.Tensor)
    if p.dim() != 1 or p.shape != q.shape:
        raise ValueError(f"p and q must be 1-D distributions of the same size, got shapes "
                         f"{tuple(p.shape)} and {tuple(q.shape)}")
    check_int("token", token, minimum=0, maximum=p.numel() - 1)
    if q[token] <= 0:
        raise ValueError(f"token {token} has probability 0 under q, so q cannot have proposed it")
    u = torch.rand((), generator=generator, dtype=torch.float64)
    if u * q[token].double() < p[token].double():  # u < p/q, without dividing
        return True, token
    residual = (p.double() - q.double()).clamp(min=0)
    if residual.sum() <= 0:  # p == q: a rejection has probability 0; keep the token
        return True, token
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


@torch.no_grad()
def speculative_decode(target: nn.Module, draft: nn.Module, ids: torch.Tensor, max_new_tokens: int,
                       k: int = 4, temperature: float = 0.0,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, int]]:
    """Extend ``ids`` ``(1, T)`` by ``max_new_tokens`` tokens with speculative decoding.

    Each round the ``draft`` model proposes ``k`` tokens one at a time; the ``target`` model scores
    the sequence with all ``k`` proposals in one forward pass, which gives its prediction after
    every prefix. ``temperature=0`` (greedy): proposals are kept while they equal the target's
    argmax, the first disagreement is replaced by the target's token, and if all ``k`` agree the
    target's next token comes for free; the result is exactly ``target``'s greedy output. With
    ``temperature > 0`` each proposal goes through :func:`speculative_accept` on the softmax of
    both models' logits divided by ``temperature``, so every token is distributed as the target's.
    Both models are called as ``model(ids) -> (logits (1, T, V), ...)`` on the whole sequence (no
    KV cache), which must fit their context: ``T + max_new_tokens <= context_length``.

    Returns ``(ids (1, T + max_new_tokens), stats)`` with ``stats`` counting ``rounds`` (target
    forward passes), ``proposed`` and ``accepted`` draft tokens, and ``draft_calls``.
    """
    check_type("target", target, nn.Module, "torch.nn.Module")
    check_type("draft", draft, nn.Module, "torch.nn.Module")
    check_type("ids", ids, torch.Tensor)
    if ids.dim() != 2 or ids.size(0) != 1 or ids.size(1) < 1 or ids.dtype != torch.long:
        raise ValueError(f"ids must be a (1, T) tensor of token ids (int64, T >= 1), got shape "
                         f"{tuple(ids.shape)} and dtype {ids.dtype}")
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_int("k", k)
    check_number("temperature", temperature, low=0)
    for name, model in (("target", target), ("draft", draft)):
        ctx = getattr(getattr(model, "config", None), "context_length", None)
        if isinstance(ctx, int) and ids.size(1) + max_new_tokens > ctx:
            raise ValueError(f"T + max_new_tokens = {ids.size(1) + max_new_tokens} exceeds the {name} "
                             f"model's context_length={ctx}")
    was = target.training, draft.training
    target.eval()
    draft.eval()
    stats = {"rounds": 0, "proposed": 0, "accepted": 0, "draft_calls": 0}
    goal = ids.size(1) + max_new_tokens
    try:
        while ids.size(1) < goal:
            n = min(k, goal - ids.size(1))                 # never propose past the goal
            start = ids.size(1)
            proposal, q_dists = ids, []
            for _ in range(n):                             # the draft proposes n tokens
                logits = draft(proposal)[0][0, -1]         # (V,)
                stats["draft_calls"] += 1
                if temperature == 0:
                    nxt = int(logits.argmax())
                else:
                    q_dist = torch.softmax(logits.double() / temperature, dim=-1)
                    q_dists.append(q_dist)
                    nxt = int(torch.multinomial(q_dist, 1, generator=generator))
                proposal = torch.cat([proposal, proposal.new_tensor([[nxt]])], dim=1)
            logits = target(proposal)[0][0, start - 1:]    # (n + 1, V): predictions after each prefix
            stats["rounds"] += 1
            stats["proposed"] += n
            kept: list[int] = []
            for i in range(n):
                token = int(proposal[0, start + i])
                if temperature == 0:
                    best = int(logits[i].argmax())
                    accepted, out = best == token, best
                else:
                    p_dist = torch.softmax(logits[i].double() / temperature, dim=-1)
                    accepted, out = speculative_accept(p_dist, q_dists[i], token, generator)
                kept.append(out)
                if not accepted:
                    break
                stats["accepted"] += 1
            else:  # every proposal kept: the target's prediction after the last one is free
                if start + n < goal:
                    if temperature == 0:
                        kept.append(int(logits[n].argmax()))
                    else:
                        p_dist = torch.softmax(logits[n].double() / temperature, dim=-1)
                        kept.append(int(torch.multinomial(p_dist, 1, generator=generator)))
            ids = torch.cat([ids, ids.new_tensor([kept])], dim=1)
    finally:
        target.train(was[0])
        draft.train(was[1])
    return ids, stats
