"""A KV cache stored in 8 bits: one int8 per number and one float32 scale per vector.

Each new token reads the whole KV cache besides the weights, so at long contexts the
cache's size in bytes weighs on the speed of generation. :func:`quantize_int8` stores a
vector ``x`` of ``D`` numbers as ``q = round(x / c)`` with ``c = max|x| / 127``;
:class:`QuantizedKVCache` keeps keys and values that way (``D + 4`` bytes per vector
instead of ``4 D``) and hands attention the dequantised tensors.
"""
from __future__ import annotations

import torch

__all__ = ["QuantizedKVCache", "dequantize_int8", "quantize_int8"]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last dimension: ``x ≈ q * scale``.

    Returns ``(q, scale)``: ``q`` int8 with the shape of ``x``, ``scale`` float32 with
    the last dimension 1 (``max |x| / 127`` of each row; rows of zeros get scale 1). The
    rounding error of each entry is at most ``scale / 2``.
    """
    absmax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``: the inverse of :func:`quantize_int8` up to its
    rounding."""
    return (q.float() * scale).to(dtype)


class QuantizedKVCache:
    """Keys and values of every token processed so far, for one attention layer, stored
    as int8: a drop-in for :class:`lib.attention.KVCache` (the same ``length``,
    ``update`` and ``reset``).

    Each key (and value) vector of one head at one position, ``D`` numbers, is kept as
    ``D`` int8 values and one float32 scale (:func:`quantize_int8`): ``D + 4`` bytes
    instead of ``4 D``. ``update`` returns the dequantised keys and values of every
    cached position, so attention runs in floating point as usual; only what is stored
    between steps is smaller.
    """

    def __init__(self) -> None:
        # "k" and "v" -> (int8 values (B, H_kv, T, D), float32 scales (B, H_kv, T, 1))
        self.parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        """Number of cached positions."""
        return 0 if not self.parts else self.parts["k"][0].size(2)

    def update(self, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise and append ``(B, H_kv, T, D)`` keys and values; return all of them
        dequantised, ``(B, H_kv, T_cached, D)`` in the dtype of ``k``."""
        for name, x in (("k", k), ("v", v)):
            q, scale = quantize_int8(x)
            if name in self.parts:
                old_q, old_scale = self.parts[name]
                q = torch.cat([old_q, q], dim=2)
                scale = torch.cat([old_scale, scale], dim=2)
            self.parts[name] = (q, scale)
        return (dequantize_int8(*self.parts["k"], dtype=k.dtype),
                dequantize_int8(*self.parts["v"], dtype=k.dtype))

    def reset(self) -> None:
        """Forget everything (start a new sequence)."""
        self.parts = {}

    def nbytes(self) -> int:
        """Bytes stored: the int8 keys and values plus their float32 scales."""
        return sum(q.numel() * q.element_size() + s.numel() * s.element_size()
                   for q, s in self.parts.values())

    def __repr__(self) -> str:
        return f"QuantizedKVCache(length={self.length}, nbytes={self.nbytes()})"
