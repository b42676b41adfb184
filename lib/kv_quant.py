"""A KV cache stored in 8 bits: one int8 per number and one float32 scale per vector.

Each new token reads the whole KV cache, so its size in bytes sets the speed of
generation. :func:`quantize_int8` stores a vector ``x`` of ``D`` numbers as ``q =
round(x / c)`` with ``c = max|x| / 127``; :class:`QuantizedKVCache` keeps keys and
values that way (``D + 4`` bytes per vector instead of ``4 D``) and hands attention the
dequantised tensors.
"""
from __future__ import annotations

import torch

from lib.attention import KVCache

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


class QuantizedKVCache(KVCache):
    """A :class:`lib.attention.KVCache` that stores keys and values as int8.

    Each key (and value) vector of one head at one position, ``D`` numbers, is kept as
    ``D`` int8 values and one float32 scale (:func:`quantize_int8`): ``D + 4`` bytes
    instead of ``4 D``. ``update`` returns the dequantised keys and values of every
    cached position, so attention runs in floating point as usual; only what is stored
    between steps is smaller.
    """

    def __init__(self) -> None:  # no KVCache.__init__: k and v are read from the int8 parts
        self._parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._dtype = torch.float32

    @property
    def length(self) -> int:
        """Number of cached positions."""
        return 0 if not self._parts else self._parts["k"][0].size(2)

    def update(self, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise and append ``(B, H_kv, T, D)`` keys and values; return all of them
        dequantised."""
        self._dtype = k.dtype
        for name, x in (("k", k), ("v", v)):
            q, scale = quantize_int8(x)
            if name in self._parts:
                old_q, old_scale = self._parts[name]
                q = torch.cat([old_q, q], dim=2)
                scale = torch.cat([old_scale, scale], dim=2)
            self._parts[name] = (q, scale)
        return self.k, self.v

    @property
    def k(self) -> torch.Tensor | None:  # type: ignore[override]
        """The cached keys, dequantised (None when empty)."""
        return self._read("k")

    @property
    def v(self) -> torch.Tensor | None:  # type: ignore[override]
        """The cached values, dequantised (None when empty)."""
        return self._read("v")

    def _read(self, name: str) -> torch.Tensor | None:
        """Cached keys or values (``name``: "k" or "v"), dequantised; None if empty."""
        if not self._parts:
            return None
        return dequantize_int8(*self._parts[name], dtype=self._dtype)

    def reset(self) -> None:
        """Forget everything (start a new sequence)."""
        self._parts = {}

    def nbytes(self) -> int:
        """Bytes stored: the int8 keys and values plus their float32 scales."""
        return sum(q.numel() * q.element_size() + s.numel() * s.element_size()
                   for q, s in self._parts.values())

    def __repr__(self) -> str:
        return f"QuantizedKVCache(length={self.length}, nbytes={self.nbytes()})"
