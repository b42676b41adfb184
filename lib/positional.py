"""Telling a transformer where each token sits: sinusoidal table, learned table, rotary embedding.

Attention on its own treats its input as a set; these modules give it order.

- :func:`sinusoidal_table` and :class:`SinusoidalPositionalEncoding`: a fixed vector per position,
  added to the token embeddings (the original transformer).
- :class:`LearnedPositionalEmbedding`: one trained vector per position, added the same way (GPT-2).
  It knows only the positions it was built for.
- :class:`RotaryEmbedding`: rotates queries and keys by position-dependent angles inside attention,
  so that their dot product depends on relative position (RoPE, Llama). Optionally with a
  frequency scaling for longer contexts, chosen by a ``rope_scaling`` dict: position interpolation,
  NTK-aware base scaling (:func:`ntk_inv_freq`), YaRN (:func:`yarn_inv_freq`) or Llama 3's rule
  (:func:`llama3_inv_freq`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn


def _check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_base(base: object) -> float:
    """``base`` as a finite float > 1, or a ValueError."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"base must be a finite number > 1, got {base!r}")
    return float(base)


def _check_even(name: str, value: object) -> int:
    """``value`` as a positive even int, or a ValueError naming ``name``."""
    value = _check_int(name, value, 2)
    if value % 2:
        raise ValueError(f"{name} must be even (dimensions come in sin/cos pairs), got {value}")
    return value


def sinusoidal_table(n_positions: int, d_model: int, base: float = 10000.0) -> Tensor:
    """The fixed sinusoidal encoding, shape ``(n_positions, d_model)``, float32, interleaved.

    ``PE[t, 2i] = sin(t / base^(2i/d))`` and ``PE[t, 2i+1] = cos(t / base^(2i/d))``.
    """
    n_positions = _check_int("n_positions", n_positions, 1)
    d_model = _check_even("d_model", d_model)
    base = _check_base(base)
    # Angles in float64 so that large positions keep their digits; the table itself is float32.
    t = torch.arange(n_positions, dtype=torch.float64)                               # (T,)
    inv_freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d/2,)
    angles = torch.outer(t, inv_freq)                                                 # (T, d/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


class SinusoidalPositionalEncoding(nn.Module):
    """Sinusoidal encodings for positions ``0 … context_length-1``, kept as a (non-trained) buffer.

    ``forward(T, offset)`` returns rows ``offset … offset+T-1``. Being a formula, it also answers for
    positions past ``context_length`` (computed on the fly), although a model never saw them.
    """

    def __init__(self, context_length: int, d_model: int, base: float = 10000.0) -> None:
        super().__init__()
        self.context_length = _check_int("context_length", context_length, 1)
        self.d_model = _check_even("d_model", d_model)
        self.base = _check_base(base)
        self.register_buffer("table", sinusoidal_table(context_length, d_model, base), persistent=False)

    def forward(self, T: int, offset: int = 0) -> Tensor:
        """Encodings of positions ``offset … offset+T-1``: shape ``(T, d_model)``."""
        T = _check_int("T", T, 1)
        offset = _check_int("offset", offset, 0)
        if offset + T <= self.context_length:
            return self.table[offset:offset + T]
        longer = sinusoidal_table(offset + T, self.d_model, self.base)
        return longer[offset:].to(device=self.table.device, dtype=self.table.dtype)

    def extra_repr(self) -> str:
        return f"context_length={self.context_length}, d_model={self.d_model}, base={self.base:g}"


class LearnedPositionalEmbedding(nn.Module):
    """One trainable vector per position ``0 … context_length-1`` (GPT-2's ``wpe``).

    There is no vector for any later position: asking for one raises a ValueError.
    """

    def __init__(self, context_length: int, d_model: int) -> None:
        super().__init__()
        self.context_length = _check_int("context_length", context_length, 1)
        self.d_model = _check_int("d_model", d_model, 1)
        self.embedding = nn.Embedding(context_length, d_model)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=0.02)  # GPT-2's initialisation

    @property
    def weight(self) -> Tensor:
        """The table, shape ``(context_length, d_model)``."""
        return self.embedding.weight

    def forward(self, T: int, offset: int = 0) -> Tensor:
        """Embeddings of positions ``offset … offset+T-1``: shape ``(T, d_model)``."""
        T = _check_int("T", T, 1)
        offset = _check_int("offset", offset, 0)
        last = offset + T - 1
        if last >= self.context_length:
            raise ValueError(
                f"positions {offset}..{last} requested, but a learned positional embedding only has "
                f"positions 0..{self.context_length - 1} (context_length={self.context_length}); "
                f"crop the sequence to at most {self.context_length} tokens")
        positions = torch.arange(offset, offset + T, device=self.weight.device)  # (T,)
        return self.embedding(positions)                                         # (T, C)

    def extra_repr(self) -> str:
        return f"context_length={self.context_length}, d_model={self.d_model}"


ROPE_SCALING_TYPES = ("llama3", "linear", "ntk", "yarn")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Keys of each rule besides "rope_type": (required, optional with their defaults).
_SCALING_KEYS = {
    "llama3": (_LLAMA3_KEYS, {}),
    "linear": (("factor",), {}),
    "ntk": (("factor",), {}),
    "yarn": (("factor", "original_max_position_embeddings"), {"beta_fast": 32.0, "beta_slow": 1.0}),
}


def _check_positive(key: str, value: object) -> float:
    """``rope_scaling[key]`` as a finite float > 0, or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"rope_scaling['{key}'] must be a finite number > 0, got {value!r}")
    return float(value)


def check_rope_scaling(scaling: object) -> dict | None:
    """A RoPE scaling setting, validated and normalised (a new dict), or None for plain RoPE.

    ``rope_type`` picks the rule; every rule has a ``factor`` >= 1 (how many times longer the new
    context is than the one the model was trained at):

    - ``"linear"``: position interpolation (Chen et al. 2023), every frequency divided by ``factor``.
    - ``"ntk"``: NTK-aware base scaling, the base raised so that the slowest frequency is divided
      by ``factor`` and the fastest is kept (:func:`ntk_inv_freq`).
    - ``"yarn"``: YaRN (Peng et al. 2023), needs ``original_max_position_embeddings``; optional
      ``beta_fast`` (32) and ``beta_slow`` (1) bound the blend (:func:`yarn_inv_freq`), plus an
      attention temperature (:func:`rope_attention_factor`).
    - ``"llama3"``: Llama 3's rule, ``{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}`` (Llama 3.2's values); see
      :func:`llama3_inv_freq`.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be None or a dict, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope_scaling['rope_type'] must be one of {ROPE_SCALING_TYPES}, got {rope_type!r}")
    required, optional = _SCALING_KEYS[rope_type]
    allowed = {"rope_type", *required, *optional}
    missing, unknown = set(required) - set(scaling), set(scaling) - allowed
    if missing or unknown:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs the keys {sorted(['rope_type', *required])} "
                         f"(optional: {sorted(optional)}); missing {sorted(missing)}, unknown {sorted(unknown)}")
    out: dict = {"rope_type": rope_type}
    for key in (*required, *optional):
        if key == "original_max_position_embeddings":
            out[key] = _check_int(f"rope_scaling['{key}']", scaling[key], 1)
        else:
            out[key] = _check_positive(key, scaling.get(key, optional.get(key)))
    if out["factor"] < 1:
        raise ValueError(f"rope_scaling['factor'] must be >= 1 (it stretches wavelengths), got {out['factor']}")
    for low, high in (("low_freq_factor", "high_freq_factor"), ("beta_slow", "beta_fast")):
        if low in out and out[high] <= out[low]:
            raise ValueError(f"rope_scaling['{high}'] must be > rope_scaling['{low}'], got "
                             f"{out[high]} and {out[low]}")
    return out


def llama3_inv_freq(inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> Tensor:
    """Llama 3's RoPE frequency scaling: stretch the slow rotations, keep the fast ones.

    With ``L = original_max_position_embeddings`` (the context the model was first trained at) and
    each frequency's wavelength ``2*pi / inv_freq``: wavelengths shorter than ``L / high_freq_factor``
    keep their frequency; wavelengths longer than ``L / low_freq_factor`` have it divided by
    ``factor``; in between the frequency blends the two, linearly in ``L / wavelength``. Same shape
    and dtype as ``inv_freq``.
    """
    wavelength = 2 * math.pi / inv_freq
    L = original_max_position_embeddings
    smooth = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)  # 0 slow .. 1 fast
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength < L / high_freq_factor, inv_freq, blended)
    return torch.where(wavelength > L / low_freq_factor, inv_freq / factor, out)


def ntk_inv_freq(inv_freq: Tensor, factor: float) -> Tensor:
    """NTK-aware scaling: the frequencies of base ``base * factor^(D/(D-2))`` instead of ``base``.

    With ``n = D/2`` frequencies ``inv_freq[i] = base^(-i/n)``, the new base multiplies frequency
    ``i`` by ``factor^(-i/(n-1))``: the fastest pair (``i = 0``) keeps its frequency, the slowest
    (``i = n-1``) is divided by exactly ``factor``, and those between are divided by a geometric
    blend. Written on ``inv_freq`` directly, so the base need not be known. Same shape and dtype.
    """
    n = inv_freq.shape[-1]
    i = torch.arange(n, dtype=inv_freq.dtype, device=inv_freq.device)
    return inv_freq * factor ** (-i / max(n - 1, 1))


def yarn_inv_freq(inv_freq: Tensor, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> Tensor:
    """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023), in the paper's form.

    ``r = L / wavelength`` counts the turns a pair makes within the original context ``L``. Pairs
    with ``r < beta_slow`` are interpolated (frequency divided by ``factor``), pairs with
    ``r > beta_fast`` are kept, and between them the frequency blends the two with weight
    ``(r - beta_slow) / (beta_fast - beta_slow)`` on the kept one. Llama 3's rule is this blend
    with ``beta_slow = low_freq_factor`` and ``beta_fast = high_freq_factor``. Same shape and dtype.
    """
    turns = original_max_position_embeddings * inv_freq / (2 * math.pi)   # r, turns within L
    keep = ((turns - beta_slow) / (beta_fast - beta_slow)).clamp(0, 1)     # 0 interpolate .. 1 keep
    return (1 - keep) * inv_freq / factor + keep * inv_freq


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor by which a scaling rule multiplies cos and sin (so q·k by its square).

    YaRN's temperature: ``0.1 * ln(factor) + 1``, which sharpens attention that longer contexts
    would spread out; 1.0 for every other rule and for plain RoPE.
    """
    scaling = check_rope_scaling(scaling)
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    return 0.1 * math.log(scaling["factor"]) + 1.0


def scale_inv_freq(inv_freq: Tensor, scaling: dict | None) -> Tensor:
    """``inv_freq`` under the scaling rule ``scaling`` names (see :func:`check_rope_scaling`); None: unchanged."""
    scaling = check_rope_scaling(scaling)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "ntk":
        return ntk_inv_freq(inv_freq, scaling["factor"])
    if rope_type == "yarn":
        return yarn_inv_freq(inv_freq, **{k: v for k, v in scaling.items() if k != "rope_type"})
    return llama3_inv_freq(inv_freq, **{k: scaling[k] for k in _LLAMA3_KEYS})


def rotate_half(x: Tensor) -> Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension (a 90° turn of each pair)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) for queries and keys, half-split ("rotate_half") layout.

    Dimension ``i`` and dimension ``i + D/2`` form a pair that is rotated by the angle
    ``position * base^(-2i/D)``. Rotating both queries and keys makes ``q·k`` depend only on the
    distance between their positions. Angles, cos and sin are computed in float64 (as
    :func:`sinusoidal_table` does) and rounded once, to the input's dtype. ``scaling`` (None: plain
    RoPE) rescales the frequencies, e.g. Llama 3's rule (:func:`check_rope_scaling`); YaRN also
    multiplies cos and sin by :func:`rope_attention_factor`.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = _check_even("head_dim", head_dim)
        self.base = _check_base(base)
        self.scaling = check_rope_scaling(scaling)
        self.attention_factor = rope_attention_factor(self.scaling)  # 1.0 except for YaRN
        inv_freq = self.base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        inv_freq = scale_inv_freq(inv_freq, self.scaling)
        # (D/2,) float32, for inspection and to follow the module's device; the angles recompute
        # the frequencies in float64.
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        # cos and sin tables already computed, per (device, dtype): positions 0 ... n-1, grown on
        # demand. Training asks for the same positions at every step of every layer; without the
        # tables each call would redo the float64 trigonometry (a large part of a small model's
        # CPU step, measured in docs/benchmarks.md).
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def _angles64(self, positions: Tensor) -> Tensor:
        """``positions (P,) -> (P, D/2)`` angles in float64, on the buffers' device (CPU for MPS,
        which has no float64). A float32 angle near position 100,000 is off by ~0.004 rad."""
        device = self.inv_freq.device
        device = torch.device("cpu") if device.type == "mps" else device
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim
        inv_freq = scale_inv_freq(self.base ** -exponents, self.scaling)    # (D/2,), float64
        return torch.outer(positions.to(device, torch.float64), inv_freq)    # (P, D/2)

    def angles(self, positions: Tensor | Sequence[int] | int) -> Tensor:
        """Rotation angles, shape ``(P, D/2)``: entry ``[p, i] = positions[p] * base^(-2i/D)``.

        ``positions`` is a 1-D tensor or sequence of positions, or an int ``n`` meaning ``0 … n-1``.
        Computed in float64, returned as float32.
        """
        if isinstance(positions, int) and not isinstance(positions, bool):
            positions = torch.arange(_check_int("positions", positions, 1))
        elif not isinstance(positions, Tensor):
            if isinstance(positions, (str, bytes)) or not isinstance(positions, Sequence):
                raise TypeError(f"positions must be an int, a sequence or a 1-D tensor, got "
                                f"{type(positions).__name__}")
            positions = torch.tensor(positions)
        if positions.ndim != 1 or positions.is_complex() or positions.dtype == torch.bool:
            raise ValueError(f"positions must be a 1-D real tensor, got shape {tuple(positions.shape)} "
                             f"and dtype {positions.dtype}")
        return self._angles64(positions).float().to(self.inv_freq.device)

    def cos_sin(self, T: int, offset: int = 0, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles for positions ``offset … offset+T-1``, each ``(T, D)``, in
        ``dtype`` (float32 by default).

        Angles, cos and sin are computed in float64 and only then rounded to ``dtype``: a float32
        angle at position 100,000 would already be off by about 0.004 rad.
        """
        T = _check_int("T", T, 1)
        offset = _check_int("offset", offset, 0)
        device = torch.device(self.inv_freq.device if device is None else device)
        cos, sin = self._tables.get((device, dtype), (None, None))
        if cos is None or len(cos) < offset + T:  # compute (twice as many as needed) and keep
            n = max(2 * (offset + T), 0 if cos is None else 2 * len(cos))
            angles = self._angles64(torch.arange(n, device=self.inv_freq.device))  # (n, D/2)
            angles = torch.cat((angles, angles), dim=-1)  # (n, D): dims i, i + D/2 share an angle
            cos, sin = angles.cos(), angles.sin()
            if self.attention_factor != 1.0:  # YaRN's temperature: q·k scaled by its square
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            cos, sin = cos.to(device, dtype), sin.to(device, dtype)
            self._tables[(device, dtype)] = (cos, sin)
        return cos[offset:offset + T], sin[offset:offset + T]  # (T, D) each

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """Rotate ``x`` of shape ``(B, H, T, D)`` (any ``(..., T, D)``) by positions ``offset … offset+T-1``."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have shape (..., T, head_dim={self.head_dim}), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        offset = _check_int("offset", offset, 0)
        T = x.shape[-2]
        if T == 0:
            return x
        cos, sin = self.cos_sin(T, offset, device=x.device, dtype=x.dtype)  # (T, D) each
        return x * cos + rotate_half(x) * sin                      # (..., T, D)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return f"head_dim={self.head_dim}, base={self.base:g}{scaling}"
