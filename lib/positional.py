"""Telling a transformer where each token sits: sinusoidal table, learned table, RoPE.

Attention on its own treats its input as a set; these modules give it order.

- :func:`sinusoidal_table` and :class:`SinusoidalPositionalEncoding`: a fixed vector per
  position, added to the token embeddings (the original transformer).
- :class:`LearnedPositionalEmbedding`: one trained vector per position, added the same
  way (GPT-2). It knows only the positions it was built for.
- :class:`RotaryEmbedding`: rotates queries and keys by position-dependent angles inside
  attention, so that their dot product depends on relative position (RoPE, Llama). Its
  frequencies come from one function, :func:`rope_inv_freq`, optionally under a scaling
  rule for longer contexts chosen by a ``rope_scaling`` dict
  (:func:`check_rope_scaling`): position interpolation, the NTK-aware base change, YaRN
  (:func:`yarn_inv_freq`) or Llama 3's rule (:func:`llama3_inv_freq`).
- :func:`padded_positions`: the positions of the tokens of left-padded rows, which a
  batch of prompts of different lengths needs (:meth:`lib.model.GPT.generate`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn

from lib.checks import check_choice, check_int, check_number


def sinusoidal_table(n_positions: int, d_model: int, base: float = 10000.0) -> Tensor:
    """The fixed sinusoidal encoding, ``(n_positions, d_model)``, float32, interleaved.

    ``PE[t, 2i] = sin(t / base^(2i/d))`` and ``PE[t, 2i+1] = cos(t / base^(2i/d))``.
    """
    # Angles in float64 so that large positions keep their digits; the table is float32.
    t = torch.arange(n_positions, dtype=torch.float64)                     # (T,)
    i2 = torch.arange(0, d_model, 2, dtype=torch.float64)                  # 2i
    angles = torch.outer(t, base ** (-i2 / d_model))                       # (T, d/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


class SinusoidalPositionalEncoding(nn.Module):
    """Sinusoidal encodings for positions ``0 … context_length-1``, a (non-trained)
    buffer.

    ``forward(T, offset)`` returns rows ``offset … offset+T-1``. Being a formula, it
    also answers for positions past ``context_length`` (computed on the fly), although a
    model never saw them: standalone use only, since a GPT builds it with its own
    ``context_length`` and never asks past it.
    """

    def __init__(self, context_length: int, d_model: int,
                 base: float = 10000.0) -> None:
        super().__init__()
        self.context_length, self.d_model, self.base = context_length, d_model, base
        table = sinusoidal_table(context_length, d_model, base)
        self.register_buffer("table", table, persistent=False)

    def forward(self, T: int, offset: int = 0) -> Tensor:
        """Encodings of positions ``offset … offset+T-1``: shape ``(T, d_model)``."""
        if offset + T <= self.context_length:
            return self.table[offset:offset + T]
        longer = sinusoidal_table(offset + T, self.d_model, self.base)
        return longer[offset:].to(device=self.table.device, dtype=self.table.dtype)

    def extra_repr(self) -> str:
        return (f"context_length={self.context_length}, d_model={self.d_model}, "
                f"base={self.base:g}")


class LearnedPositionalEmbedding(nn.Module):
    """One trainable vector per position ``0 … context_length-1`` (GPT-2's ``wpe``).

    There is no vector for any later position (:meth:`lib.model.GPT.embed` refuses
    sequences longer than the context).
    """

    def __init__(self, context_length: int, d_model: int) -> None:
        super().__init__()
        self.context_length, self.d_model = context_length, d_model
        self.embedding = nn.Embedding(context_length, d_model)
        # N(0, 0.02) as the other weights (OpenAI's GPT-2 code used 0.01 for wpe)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=0.02)

    @property
    def weight(self) -> Tensor:
        """The table, shape ``(context_length, d_model)``."""
        return self.embedding.weight

    def forward(self, T: int, offset: int = 0) -> Tensor:
        """Embeddings of positions ``offset … offset+T-1``: shape ``(T, d_model)``."""
        positions = torch.arange(offset, offset + T, device=self.weight.device)  # (T,)
        return self.embedding(positions)                                  # (T, C)

    def extra_repr(self) -> str:
        return f"context_length={self.context_length}, d_model={self.d_model}"


ROPE_SCALING_TYPES = ("linear", "ntk", "yarn", "llama3")
# Keys of each rule besides "rope_type": (required, optional with their defaults).
_SCALING_KEYS = {
    "linear": (("factor",), {}),
    "ntk": (("factor",), {}),
    "yarn": (("factor", "original_max_position_embeddings"),
             {"beta_fast": 32.0, "beta_slow": 1.0}),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), {}),
}


def check_rope_scaling(scaling: object) -> dict | None:
    """A RoPE scaling setting, validated and normalised (a new dict); None: plain RoPE.

    ``rope_type`` picks the rule; every rule has a ``factor`` >= 1 (how many times
    longer the new context is than the one the model was trained at). "linear", "yarn"
    and "llama3" are Hugging Face's rope types and compute what
    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` computes (tested); "ntk" is
    not one of them:

    - ``"linear"``: position interpolation (Chen et al. 2023), frequencies / ``factor``.
    - ``"ntk"``: the NTK-aware base change (bloc97, 2023), the base multiplied by
      ``factor ** (D / (D - 2))``; Hugging Face's "dynamic" recomputes the base when a
      sequence outgrows the longest seen (the original base below the original context).
    - ``"yarn"``: YaRN (Peng et al. 2023), needs ``original_max_position_embeddings``;
      optional ``beta_fast`` (32) and ``beta_slow`` (1) bound the blend
      (:func:`yarn_inv_freq`), plus an attention factor (:func:`rope_attention_factor`).
    - ``"llama3"``: Meta's ``apply_scaling`` for Llama 3.1+, e.g. Llama 3.2's
      ``{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``
      (:func:`llama3_inv_freq`).
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be None or a dict, "
                        f"got {type(scaling).__name__}")
    rope_type = check_choice("rope_scaling['rope_type']", scaling.get("rope_type"),
                             ROPE_SCALING_TYPES)
    required, optional = _SCALING_KEYS[rope_type]
    missing = set(required) - set(scaling)
    unknown = set(scaling) - {"rope_type", *required, *optional}
    if missing or unknown:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs the keys "
                         f"{sorted(required)} "
                         f"(optional: {sorted(optional)}); missing {sorted(missing)}, "
                         f"unknown {sorted(unknown)}")
    out: dict = {"rope_type": rope_type}
    for key in (*required, *optional):
        name, value = f"rope_scaling['{key}']", scaling.get(key, optional.get(key))
        if key == "original_max_position_embeddings":
            out[key] = check_int(name, value)
        else:
            out[key] = check_number(name, value, low=1 if key == "factor" else 0,
                                    low_open=key != "factor")
    for low, high in (("low_freq_factor", "high_freq_factor"),
                      ("beta_slow", "beta_fast")):
        if low in out and out[high] <= out[low]:
            raise ValueError(f"rope_scaling['{high}'] must be > rope_scaling['{low}'], "
                             f"got {out[high]} and {out[low]}")
    return out


def llama3_inv_freq(inv_freq: Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float,
                    original_max_position_embeddings: int) -> Tensor:
    """Llama 3's RoPE frequency scaling (Meta's ``apply_scaling``): stretch the slow
    rotations, keep the fast ones.

    With ``L = original_max_position_embeddings`` (the context the model was first
    trained at) and each frequency's wavelength ``2*pi / inv_freq``: wavelengths shorter
    than ``L / high_freq_factor`` keep their frequency; wavelengths longer than ``L /
    low_freq_factor`` have it divided by ``factor``; in between the frequency blends the
    two, linearly in ``L / wavelength`` (the turns within ``L``). Same shape and dtype
    as ``inv_freq``.
    """
    wavelength = 2 * math.pi / inv_freq
    L = original_max_position_embeddings
    smooth = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq    # 0 slow .. 1 fast
    out = torch.where(wavelength < L / high_freq_factor, inv_freq, blended)
    return torch.where(wavelength > L / low_freq_factor, inv_freq / factor, out)


def yarn_inv_freq(head_dim: int, base: float, factor: float,
                  original_max_position_embeddings: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> Tensor:
    """YaRN's "NTK-by-parts" frequencies, as YaRN's reference code and Hugging Face
    compute them.

    Pair ``i`` turns ``L * theta_i / (2*pi)`` times within ``L =
    original_max_position_embeddings``, fewer for larger ``i``. ``low`` is the pair
    index (rounded down) that turns ``beta_fast`` times, ``high`` the one (rounded up)
    that turns ``beta_slow`` times. Pairs up to ``low`` keep their frequency, pairs from
    ``high`` on have it divided by ``factor``, and between them the blend is linear in
    the pair index. Returns ``(head_dim/2,)`` float64.
    """
    L = original_max_position_embeddings

    def pair_turning(turns: float) -> float:  # the (fractional) pair making that many
        return head_dim * math.log(L / (2 * math.pi * turns)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(beta_fast)), 0)
    high = min(math.ceil(pair_turning(beta_slow)), head_dim - 1)
    high = high + 0.001 if high == low else high               # as the reference does
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    stretch = ((i - low) / (high - low)).clamp(0, 1)           # 0 keep .. 1 interpolate
    theta = rope_inv_freq(head_dim, base)
    return (1 - stretch) * theta + stretch * theta / factor


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor by which a scaling rule multiplies cos and sin (so q·k by its square).

    YaRN's ``0.1 * ln(factor) + 1``, which sharpens attention that longer contexts would
    spread out; 1.0 for every other rule and for plain RoPE.
    """
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    return 0.1 * math.log(scaling["factor"]) + 1.0


def rope_inv_freq(head_dim: int, base: float = 10000.0,
                  scaling: dict | None = None) -> Tensor:
    """RoPE's frequencies ``theta_i = base^(-2i/D)``, ``i = 0 … D/2-1``, float64, under
    the rule ``scaling`` names (a dict from :func:`check_rope_scaling`; None: plain
    RoPE)."""
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return theta
    rule = {k: v for k, v in scaling.items() if k != "rope_type"}
    if scaling["rope_type"] == "linear":
        return theta / rule["factor"]
    if scaling["rope_type"] == "ntk":
        ntk_base = base * rule["factor"] ** (head_dim / (head_dim - 2))
        return rope_inv_freq(head_dim, ntk_base)
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(head_dim, base, **rule)
    return llama3_inv_freq(theta, **rule)


def padded_positions(T: int, offset: int, n_pad: Tensor) -> Tensor:
    """Positions ``(B, T)`` of the tokens at indices ``offset … offset+T-1`` of rows
    that open with ``n_pad[b]`` padding tokens (left padding): each row's first token
    is at position 0, and so is its padding (as transformers counts them)."""
    index = torch.arange(offset, offset + T, device=n_pad.device)              # (T,)
    return (index - n_pad[:, None]).clamp(min=0)                               # (B, T)


def rotate_half(x: Tensor) -> Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension: a 90° turn of
    each pair."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) for queries and keys, half-split layout.

    Dimension ``i`` and dimension ``i + D/2`` form a pair that is rotated by the angle
    ``position * base^(-2i/D)``. Rotating both queries and keys makes ``q·k`` depend
    only on the distance between their positions. ``scaling`` (None: plain RoPE)
    rescales the frequencies (:func:`check_rope_scaling`); YaRN also multiplies cos and
    sin by :func:`rope_attention_factor`.

    cos and sin of positions ``0 … context_length-1`` are computed once, in float64 (a
    float32 angle near position 100,000 is off by ~0.004 rad), and kept as float32
    buffers that move with the module. A model owns one and shares it among its blocks.
    Later positions are computed the same way when asked for (standalone use only, e.g.
    tests/test_cpu_kernels.py at offset 5000: a GPT builds it with its own
    ``context_length`` and never asks past it).
    """

    def __init__(self, head_dim: int, base: float = 10000.0,
                 scaling: dict | None = None, context_length: int = 4096) -> None:
        super().__init__()
        self.head_dim, self.base, self.context_length = head_dim, base, context_length
        self.scaling = scaling  # checked where it enters (GPTConfig)
        self.attention_factor = rope_attention_factor(self.scaling)  # 1.0 except YaRN
        cos, sin = self._cos_sin64(torch.arange(context_length))
        self.register_buffer("cos", cos.float(), persistent=False)           # (ctx, D)
        self.register_buffer("sin", sin.float(), persistent=False)

    def _cos_sin64(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin ``(P, D)`` of ``positions (P,)``, in float64."""
        angles = self._angles64(positions)
        angles = torch.cat((angles, angles), dim=-1)  # dims i, i + D/2: one angle
        factor = self.attention_factor
        return angles.cos() * factor, angles.sin() * factor

    def _angles64(self, positions: Tensor) -> Tensor:
        """``positions (P,) -> (P, D/2)`` angles ``position * theta_i`` in float64."""
        inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling)
        return torch.outer(positions.to(inv_freq.device, torch.float64), inv_freq)

    def angles(self, positions: Tensor | Sequence[float] | int) -> Tensor:
        """Rotation angles, shape ``(P, D/2)``: entry ``[p, i] = positions[p] *
        theta_i``.

        ``positions`` is a 1-D tensor or sequence of positions, or an int ``n`` meaning
        ``0 … n-1``. Computed in float64, returned as float32.
        """
        if isinstance(positions, int):
            positions = torch.arange(positions)
        return self._angles64(torch.as_tensor(positions)).float().to(self.cos.device)

    def cos_sin(self, T: int, offset: int = 0) -> tuple[Tensor, Tensor]:
        """cos and sin of positions ``offset … offset+T-1``, each ``(T, D)``, in the
        buffers' dtype; from the tables, or computed the same way past
        ``context_length`` (standalone use: a GPT never asks past it)."""
        if offset + T <= self.context_length:
            return self.cos[offset:offset + T], self.sin[offset:offset + T]
        cos, sin = self._cos_sin64(torch.arange(offset, offset + T))
        return cos.to(self.cos), sin.to(self.sin)

    def forward(self, x: Tensor, offset: int = 0, n_pad: Tensor | None = None
                ) -> Tensor:
        """Rotate ``x (..., T, D)`` by positions ``offset … offset+T-1``; with ``n_pad``
        ``(B,)`` (left padding), ``x (B, H, T, D)`` by :func:`padded_positions`."""
        T = x.shape[-2]
        if n_pad is None:
            cos, sin = self.cos_sin(T, offset)                        # (T, D) each
        else:  # each row's own positions (B, T) -> (B, 1, T, D), the same for all heads
            positions = padded_positions(T, offset, n_pad)  # all below offset + T
            cos, sin = self.cos_sin(offset + T)
            cos, sin = cos[positions][:, None], sin[positions][:, None]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + rotate_half(x) * sin                         # (..., T, D)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return (f"head_dim={self.head_dim}, base={self.base:g}, "
                f"context_length={self.context_length}{scaling}")
