"""lib.positional.RotaryEmbedding against an implementation written by others: Hugging Face's Llama.

`transformers` (a development requirement) ships Llama's rotary embedding in the same half-split
("rotate_half") layout as lib: `LlamaRotaryEmbedding` gives cos and sin for position ids, and
`apply_rotary_pos_emb` rotates queries and keys with them. Nothing is downloaded: the config is
built in memory and no weights are involved.

The one deliberate difference: transformers computes the angles `position * inv_freq` in float32,
lib in float64 (rounded once, at the end). Below a few thousand positions the two agree to float32
rounding; at long-context positions lib stays on the float64 answer and transformers drifts.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from lib.positional import RotaryEmbedding

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is a development requirement")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)


def hf_rotary(head_dim: int, base: float, n_heads: int = 4) -> LlamaRotaryEmbedding:
    """Llama's rotary module for one head width and base, from an in-memory config."""
    config = LlamaConfig(hidden_size=head_dim * n_heads, num_attention_heads=n_heads,
                         num_key_value_heads=n_heads, head_dim=head_dim,
                         max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": base})
    return LlamaRotaryEmbedding(config)


def float64_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Half-split RoPE of x (..., T, D) computed entirely in float64: the exact answer."""
    D = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = positions.to(torch.float64)[:, None] * inv_freq          # (T, D/2)
    angles = torch.cat((angles, angles), dim=-1)                      # (T, D)
    x64 = x.to(torch.float64)
    x1, x2 = x64[..., :D // 2], x64[..., D // 2:]
    return x64 * angles.cos() + torch.cat((-x2, x1), dim=-1) * angles.sin()


@pytest.mark.parametrize("head_dim,base", [(64, 10000.0), (128, 500000.0), (16, 10000.0)])
@pytest.mark.parametrize("offset", [0, 37])
def test_lib_matches_llama_rotary(head_dim: int, base: float, offset: int) -> None:
    g = torch.Generator().manual_seed(head_dim + offset)
    B, H, T = 2, 4, 256
    q = torch.randn(B, H, T, head_dim, generator=g)
    k = torch.randn(B, H, T, head_dim, generator=g)
    hf = hf_rotary(head_dim, base, n_heads=H)
    ours = RotaryEmbedding(head_dim, base=base)
    torch.testing.assert_close(ours.angles(torch.tensor([1]))[0], hf.inv_freq)  # the frequencies

    position_ids = torch.arange(offset, offset + T).expand(B, T)     # (B, T)
    cos, sin = hf(q, position_ids)                                   # (B, T, D) each
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)                # (B, H, T, D)
    # Angles up to ~300 rad: a float32 angle is off by up to ~1.5e-5 in transformers.
    torch.testing.assert_close(ours(q, offset=offset), q_hf, rtol=0, atol=2e-4)
    torch.testing.assert_close(ours(k, offset=offset), k_hf, rtol=0, atol=2e-4)

    # Same layout, same formula: fed lib's cos and sin, transformers' rotation is lib's, exactly.
    cos_l, sin_l = ours.cos_sin(T, offset)                           # (T, D) each
    q_hf2, k_hf2 = apply_rotary_pos_emb(q, k, cos_l[None], sin_l[None])
    assert torch.equal(q_hf2, ours(q, offset=offset))
    assert torch.equal(k_hf2, ours(k, offset=offset))


def test_scores_match_llama_rotary() -> None:
    """What attention sees: q·k score matrices after rotation agree."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 128, 64, generator=g)
    k = torch.randn(1, 2, 128, 64, generator=g)
    hf, ours = hf_rotary(64, 10000.0, n_heads=2), RotaryEmbedding(64)
    cos, sin = hf(q, torch.arange(128)[None])
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    scores_hf = q_hf @ k_hf.transpose(-2, -1)
    scores_ours = ours(q) @ ours(k).transpose(-2, -1)
    torch.testing.assert_close(scores_ours, scores_hf, rtol=1e-5, atol=1e-4)


def test_at_long_context_lib_stays_on_the_float64_answer() -> None:
    """Past 100k positions, float32 angles (transformers) drift; lib's float64 angles do not."""
    D, base, T, offset = 128, 500000.0, 64, 131_000
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, T, D, generator=g)
    positions = torch.arange(offset, offset + T)
    exact = float64_rope(q, positions, base)

    ours = RotaryEmbedding(D, base=base)(q, offset=offset)
    cos, sin = hf_rotary(D, base, n_heads=1)(q, positions[None])
    theirs, _ = apply_rotary_pos_emb(q, q, cos, sin)

    err_ours = (ours.double() - exact).abs().max().item()
    err_theirs = (theirs.double() - exact).abs().max().item()
    assert err_ours < 1e-5                 # float32 rounding of the result only
    assert err_theirs > 100 * err_ours     # float32 angles near 131,000 are off by ~0.01 rad
    assert err_theirs < 0.1                # but still the same rotation, roughly
    assert math.isfinite(err_theirs)
