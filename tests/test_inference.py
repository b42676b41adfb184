"""RoPE scaling rules, attention sinks, tiled attention, the int8 KV cache, speculative decoding."""
import math

import pytest
import torch
import torch.nn.functional as F

from lib.attention import KVCache, attention_mask
from lib.config import LLAMA3_ROPE_SCALING, GPTConfig
from lib.inference import (QuantizedKVCache, dequantize_int8, quantize_int8, set_window,
                           speculative_accept, speculative_decode, tiled_attention)
from lib.model import GPT
from lib.positional import (RotaryEmbedding, check_rope_scaling, llama3_inv_freq, ntk_inv_freq,
                            rope_attention_factor, scale_inv_freq, yarn_inv_freq)

INV = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)


def test_linear_divides_every_frequency():
    out = scale_inv_freq(INV, {"rope_type": "linear", "factor": 4})
    torch.testing.assert_close(out, INV / 4)


def test_ntk_is_plain_rope_with_a_larger_base():
    D, s = 64, 8.0
    ours = ntk_inv_freq(INV, s)
    base = 10000.0 * s ** (D / (D - 2))
    torch.testing.assert_close(ours, base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D))
    assert ours[0] == INV[0] and math.isclose(ours[-1] / INV[-1], 1 / s)


def test_yarn_with_llama_bounds_is_llama3():
    ours = yarn_inv_freq(INV, 8.0, 256, beta_fast=4.0, beta_slow=1.0)
    torch.testing.assert_close(ours, llama3_inv_freq(INV, 8.0, 1.0, 4.0, 256))


def test_yarn_keeps_fast_and_interpolates_slow_pairs():
    out = yarn_inv_freq(INV, 4.0, 128)
    turns = 128 * INV / (2 * math.pi)
    assert torch.equal(out[turns > 32], INV[turns > 32])
    torch.testing.assert_close(out[turns < 1], INV[turns < 1] / 4)


def test_yarn_temperature_scales_cos_and_sin():
    plain = RotaryEmbedding(16)
    yarn = RotaryEmbedding(16, scaling={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32})
    factor = 0.1 * math.log(4) + 1
    assert math.isclose(rope_attention_factor(yarn.scaling), factor)
    cos, sin = yarn.cos_sin(8)
    assert torch.allclose(cos.pow(2) + sin.pow(2), torch.full_like(cos, factor ** 2))
    assert plain.attention_factor == 1.0 and rope_attention_factor(None) == 1.0


def test_check_rope_scaling_fills_yarn_defaults():
    out = check_rope_scaling({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 64})
    assert out == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                   "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("bad, match", [
    ({"rope_type": "ntk"}, "factor"),
    ({"rope_type": "linear", "factor": 0.5}, "factor"),
    ({"rope_type": "linear", "factor": 2, "beta_fast": 3}, "unknown"),
    ({"rope_type": "yarn", "factor": 2}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 64, "beta_fast": 1,
      "beta_slow": 2}, "beta_fast"),
    ({"rope_type": "dynamic", "factor": 2}, "rope_type"),
    ({"rope_type": "ntk", "factor": True}, "factor"),
])
def test_bad_rope_scaling(bad, match):
    with pytest.raises(ValueError, match=match):
        check_rope_scaling(bad)


def test_llama_style_preset_uses_llama3_scaling():
    config = GPTConfig.llama_style()
    assert config.rope_scaling == check_rope_scaling(LLAMA3_ROPE_SCALING)
    assert LLAMA3_ROPE_SCALING == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert config.context_length == 131072


def test_sinks_keep_the_first_positions_visible():
    mask = attention_mask(6, 6, window=2, sinks=1)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert torch.equal(attention_mask(5, 5, window=2), attention_mask(5, 5, window=2, sinks=0))
    with pytest.raises(ValueError, match="sinks"):
        attention_mask(3, 3, window=2, sinks=-1)


def small_model(seed=0, **kw):
    torch.manual_seed(seed)
    config = GPTConfig.tiny(vocab_size=11, context_length=48, d_model=32, n_layers=2, n_heads=4, d_ff=64, **kw)
    return GPT(config).eval()


def test_set_window_matches_explicit_path_and_restores():
    model = small_model(positions="rope")
    ids = torch.randint(0, 11, (2, 40))
    full = model(ids)[0]
    assert set_window(model, 8, sinks=2) == 2
    fast = model(ids)[0]
    model.set_fast(False)
    torch.testing.assert_close(model(ids)[0], fast, atol=1e-5, rtol=1e-5)
    model.set_fast(True)
    assert not torch.allclose(fast, full)
    set_window(model, None)
    torch.testing.assert_close(model(ids)[0], full)
    with pytest.raises(ValueError, match="sinks"):
        set_window(model, None, sinks=1)
    with pytest.raises(TypeError, match="model"):
        set_window("model", 4)


@pytest.mark.parametrize("T, T_k, bq, bk, H_kv", [(37, 37, 8, 16, 4), (5, 40, 4, 7, 2), (64, 64, 64, 64, 1)])
def test_tiled_attention_equals_sdpa(T, T_k, bq, bk, H_kv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, H_kv, T_k, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, H_kv, T_k, 16, generator=g, dtype=torch.float64)
    mask = attention_mask(T, T_k)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4 // H_kv, 1), v.repeat_interleave(4 // H_kv, 1),
                                         attn_mask=mask)
    torch.testing.assert_close(tiled_attention(q, k, v, bq, bk), ref)
    ref_full = F.scaled_dot_product_attention(q, k.repeat_interleave(4 // H_kv, 1), v.repeat_interleave(4 // H_kv, 1))
    torch.testing.assert_close(tiled_attention(q, k, v, bq, bk, causal=False), ref_full)


def test_tiled_attention_bad_inputs():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="block_q"):
        tiled_attention(q, q, q, block_q=0)
    with pytest.raises(ValueError, match="q must be"):
        tiled_attention(q, q[..., :4], q)
    with pytest.raises(ValueError, match="causal"):
        tiled_attention(q, q[..., :2, :], q[..., :2, :])
    with pytest.raises(TypeError, match="q"):
        tiled_attention([1], q, q)


def test_quantize_round_trip_error_bound():
    x = torch.randn(3, 4, 10, 16) * 5
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 4, 10, 1)
    assert ((dequantize_int8(q, scale) - x).abs() <= scale / 2 + 1e-6).all()
    q0, s0 = quantize_int8(torch.zeros(2, 3))
    assert torch.equal(dequantize_int8(q0, s0), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="x must"):
        quantize_int8(torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="q must"):
        dequantize_int8(torch.ones(3), torch.ones(1))


def test_quantized_cache_is_a_drop_in_and_smaller():
    model = small_model(positions="rope", n_kv_heads=2)
    ids = torch.randint(0, 11, (1, 20))
    full = model(ids)[0]
    caches = [QuantizedKVCache() for _ in model.blocks]
    first = model(ids[:, :12], kv_caches=caches)[0]
    rest = model(ids[:, 12:], kv_caches=caches)[0]
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=0.05, rtol=0)
    assert caches[0].length == 20
    D, H_kv = model.config.head_dim, model.config.kv_heads
    assert caches[0].nbytes() == 2 * 20 * H_kv * (D + 4)
    assert caches[0].k.shape == (1, H_kv, 20, D)
    caches[0].reset()
    assert caches[0].length == 0 and caches[0].k is None
    with pytest.raises(ValueError, match="update"):
        caches[0].k = torch.zeros(1)


def test_speculative_greedy_equals_target_greedy():
    target, draft = small_model(0), small_model(1)
    ids = torch.tensor([[1, 2, 3]])
    ref = target.generate(ids, 30, temperature=0.0)
    for k in (1, 3, 5):
        out, stats = speculative_decode(target, draft, ids, 30, k=k)
        assert torch.equal(out, ref)
        assert stats["rounds"] <= 30 and stats["accepted"] <= stats["proposed"]
    out, stats = speculative_decode(target, target, ids, 30, k=4)
    assert torch.equal(out, ref) and stats["accepted"] == stats["proposed"] and stats["rounds"] == 6


def test_speculative_sampling_runs_and_bad_inputs():
    target, draft = small_model(0), small_model(1)
    ids = torch.tensor([[1, 2, 3]])
    out, stats = speculative_decode(target, draft, ids, 10, k=3, temperature=1.0,
                                    generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 13) and torch.equal(out[:, :3], ids)
    with pytest.raises(ValueError, match="context_length"):
        speculative_decode(target, draft, ids, 46)
    with pytest.raises(ValueError, match="k must"):
        speculative_decode(target, draft, ids, 5, k=0)
    with pytest.raises(ValueError, match="ids must"):
        speculative_decode(target, draft, ids[0], 5)
    with pytest.raises(ValueError, match="temperature"):
        speculative_decode(target, draft, ids, 5, temperature=-1.0)


def test_speculative_accept_gives_the_target_distribution():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4, dtype=torch.float64)
    n = 20000
    draws = torch.multinomial(q, n, replacement=True, generator=g)
    for t in draws.tolist():
        counts[speculative_accept(p, q, t, g)[1]] += 1
    assert (counts / n - p).abs().max() < 0.015
    with pytest.raises(ValueError, match="probability 0"):
        speculative_accept(q, p, 3)
    with pytest.raises(ValueError, match="token"):
        speculative_accept(p, q, 4)
    with pytest.raises(ValueError, match="same size"):
        speculative_accept(p, q[:3], 0)


def test_figure_names_may_carry_a_section_letter():
    from lib import plotting
    for good in ("12b-window", "12a-ladder", "04-attention", "A1-lora"):
        assert plotting._NAME.match(good)
    for bad in ("12B-window", "12ab-x", "1b-x", "12b_x"):
        assert not plotting._NAME.match(bad)
