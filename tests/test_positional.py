import math

import pytest
import torch

from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lib.config import LLAMA3_ROPE_SCALING, GPTConfig
from lib.model import GPT
from lib.positional import (LearnedPositionalEmbedding, RotaryEmbedding,
                            SinusoidalPositionalEncoding, check_rope_scaling, rope_attention_factor,
                            rope_inv_freq, rotate_half, sinusoidal_table)


# ---------------------------------------------------------------- sinusoidal

def test_table_matches_the_formula_entry_by_entry():
    n, d, base = 50, 12, 10000.0
    table = sinusoidal_table(n, d, base)
    assert table.shape == (n, d) and table.dtype == torch.float32
    for t in range(n):
        for i in range(d // 2):
            angle = t / base ** (2 * i / d)
            assert table[t, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[t, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_table_equals_distilberts_sinusoidal_embeddings():
    """transformers' DistilBERT fills its position table with the same interleaved formula."""
    modeling = pytest.importorskip("transformers.models.distilbert.modeling_distilbert")
    theirs = torch.empty(64, 16)
    modeling.create_sinusoidal_embeddings(64, 16, theirs)
    torch.testing.assert_close(sinusoidal_table(64, 16), theirs, rtol=0, atol=1e-6)


def test_table_other_base_and_first_row():
    table = sinusoidal_table(8, 4, base=100.0)
    assert torch.equal(table[0], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    assert table[3, 2].item() == pytest.approx(math.sin(3 / 100.0 ** 0.5), abs=1e-6)


def test_shift_by_k_is_a_fixed_linear_map():
    # PE(t + k) = M_k PE(t) with M_k block-diagonal rotations, the same for every t.
    n, d, k = 40, 8, 5
    table = sinusoidal_table(n + k, d).double()
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    M = torch.zeros(d, d, dtype=torch.float64)
    for i, w in enumerate(inv_freq):
        c, s = math.cos(k * w), math.sin(k * w)
        M[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[c, s], [-s, c]])
    torch.testing.assert_close(table[:n] @ M.T, table[k:], atol=1e-6, rtol=0)


def test_sinusoidal_module_rows_offset_and_beyond_table():
    pe = SinusoidalPositionalEncoding(16, 8)
    full = sinusoidal_table(40, 8)
    assert pe(16).shape == (16, 8)
    torch.testing.assert_close(pe(16), full[:16])
    torch.testing.assert_close(pe(3, offset=5), full[5:8])
    torch.testing.assert_close(pe(10, offset=30), full[30:40])  # a formula: no hard limit
    assert not list(pe.parameters()) and "table" not in pe.state_dict()  # a buffer, not trained


# ---------------------------------------------------------------- learned

def test_learned_embedding_rows_and_gradients():
    torch.manual_seed(0)
    emb = LearnedPositionalEmbedding(10, 6)
    assert emb.weight.shape == (10, 6) and emb.weight.requires_grad
    assert emb(10).shape == (10, 6)
    torch.testing.assert_close(emb(4, offset=6), emb.weight[6:10])
    emb(3, offset=2).sum().backward()
    rows_with_grad = emb.weight.grad.abs().sum(dim=1).nonzero().flatten().tolist()
    assert rows_with_grad == [2, 3, 4]
    assert 0.01 < emb.weight.std().item() < 0.03  # GPT-2 style init


# ---------------------------------------------------------------- rotary

def test_rotate_half_is_a_quarter_turn_of_each_pair():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(rotate_half(x), torch.tensor([-3.0, -4.0, 1.0, 2.0]))
    assert torch.equal(rotate_half(rotate_half(x)), -x)


def test_rope_matches_a_direct_pairwise_rotation():
    torch.manual_seed(0)
    D, T, base = 8, 6, 500.0
    rope = RotaryEmbedding(D, base=base)
    x = torch.randn(2, 3, T, D, dtype=torch.float64)
    out = rope(x)
    expected = torch.empty_like(x)
    for t in range(T):
        for i in range(D // 2):
            theta = t * base ** (-2 * i / D)
            c, s = math.cos(theta), math.sin(theta)
            a, b = x[..., t, i], x[..., t, i + D // 2]
            expected[..., t, i] = a * c - b * s
            expected[..., t, i + D // 2] = a * s + b * c
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rope_preserves_norms_and_leaves_position_zero_alone():
    torch.manual_seed(0)
    rope = RotaryEmbedding(16)
    x = torch.randn(2, 4, 32, 16)
    out = rope(x, offset=100)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rope(x[:, :, :1]), x[:, :, :1])


def test_rope_dot_product_depends_only_on_relative_position():
    torch.manual_seed(0)
    D = 32
    rope = RotaryEmbedding(D)
    q = torch.randn(D, dtype=torch.float64)
    k = torch.randn(D, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        qm = rope(q.view(1, 1, 1, D), offset=m)
        kn = rope(k.view(1, 1, 1, D), offset=n)
        return (qm * kn).sum().item()

    for delta in (0, 1, 3, 17, -5):
        reference = score(max(delta, 0), max(-delta, 0))  # m - n = delta at the smallest positions
        for start in (2, 10, 57, 300):
            m, n = start + max(delta, 0), start + max(-delta, 0)
            assert score(m, n) == pytest.approx(reference, abs=1e-3), (m, n)
    # ... and it does depend on the relative position.
    assert abs(score(5, 0) - score(0, 0)) > 1e-2


def test_rope_offset_matches_rotating_the_whole_sequence():
    torch.manual_seed(0)
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 2, 12, 8)
    full = rope(x)
    torch.testing.assert_close(rope(x[:, :, -1:], offset=11), full[:, :, -1:])
    torch.testing.assert_close(rope(x[:, :, 4:9], offset=4), full[:, :, 4:9])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rope_keeps_the_input_dtype(dtype):
    rope = RotaryEmbedding(8)
    x = torch.randn(1, 2, 5, 8).to(dtype)
    out = rope(x, offset=3)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), rope(x.float(), offset=3), atol=2e-2, rtol=2e-2)


def test_rope_angles_schedule():
    rope = RotaryEmbedding(8, base=10000.0)
    angles = rope.angles(4)
    assert angles.shape == (4, 4)
    torch.testing.assert_close(angles[1], torch.tensor([10000.0 ** (-i / 8) for i in range(0, 8, 2)]))
    torch.testing.assert_close(rope.angles([0, 2]), angles[[0, 2]])
    torch.testing.assert_close(rope.angles(torch.tensor([3])), angles[3:])
    cos, sin = rope.cos_sin(4, offset=0)
    torch.testing.assert_close(cos, torch.cat((angles, angles), dim=-1).cos())


def test_rope_table_past_its_context_is_computed_the_same_way():
    short, long = RotaryEmbedding(16, context_length=8), RotaryEmbedding(16, context_length=64)
    for T, offset in ((8, 0), (5, 6), (10, 40)):
        for a, b in zip(short.cos_sin(T, offset), long.cos_sin(T, offset)):
            assert torch.equal(a, b)
    x = torch.randn(1, 2, 20, 16)
    assert torch.equal(short(x, offset=3), long(x, offset=3))


def test_a_model_has_one_rope_table_shared_by_its_blocks_and_moved_with_it():
    config = GPTConfig.tiny(vocab_size=11, positions="rope", context_length=32, n_layers=3)
    model = GPT(config)
    ropes = {id(block.attn.rope) for block in model.blocks}
    assert len(ropes) == 1 and model.blocks[0].attn.rope.cos.shape == (32, config.head_dim)
    assert not any("rope" in key for key in model.state_dict())
    half = model.to(torch.bfloat16).blocks[2].attn.rope
    assert half.cos.dtype == torch.bfloat16 and model.blocks[0].attn.rope is half


# ---------------------------------------------------------------- scaling rules vs transformers

def hf_inv_freq(head_dim: int, base: float, scaling: dict, L: int) -> tuple[torch.Tensor, float]:
    """transformers' frequencies and attention factor for a rope type (its own code)."""
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=4 * L,
                         rope_parameters={"rope_theta": base, **scaling})
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")


SHAPES = [(32, 10000.0, 64, 4.0), (64, 500000.0, 8192, 32.0), (128, 10000.0, 4096, 8.0),
          (16, 10000.0, 128, 2.0), (64, 10000.0, 2048, 16.0)]


@pytest.mark.parametrize("D, base, L, s", SHAPES)
@pytest.mark.parametrize("rope_type", ["linear", "yarn", "llama3"])
def test_scaling_rules_equal_transformers(D, base, L, s, rope_type):
    scaling = {"linear": {"rope_type": "linear", "factor": s},
               "yarn": {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L},
               "llama3": {"rope_type": "llama3", "factor": s, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": L},
               }[rope_type]
    theirs, their_factor = hf_inv_freq(D, base, scaling, L)
    rope = RotaryEmbedding(D, base, scaling, context_length=16)
    ours = rope.angles(torch.tensor([1]))[0]  # position 1: the frequencies, as the module uses them
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)   # float32 there
    assert math.isclose(rope.attention_factor, their_factor, rel_tol=1e-12)
    cos, sin = rope.cos_sin(16)
    torch.testing.assert_close(cos.pow(2) + sin.pow(2), torch.full_like(cos, their_factor ** 2))


def test_yarn_ramps_in_the_pair_index_not_in_turns():
    """D=32, L=64, s=4: pair 0 turns 10.2 times within L, fewer than beta_fast=32, yet the
    shipped rule keeps it: the ramp runs over the pair index from floor(i(32)) = 0 to
    ceil(i(1)) = 5, so pair 1 is a fifth of the way to interpolated."""
    scaling = check_rope_scaling({"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 64})
    slowed = rope_inv_freq(32) / rope_inv_freq(32, scaling=scaling)
    assert slowed[0].item() == pytest.approx(1.0)
    assert slowed[1].item() == pytest.approx(1 / (1 - 0.2 * 0.75), rel=1e-9)
    assert slowed[-1].item() == pytest.approx(4.0)


@pytest.mark.parametrize("D, base, L, s", SHAPES)
def test_ntk_is_the_base_change_and_transformers_dynamic_at_s_times_L(D, base, L, s):
    """NTK-aware: plain RoPE with base * s^(D/(D-2)); transformers' "dynamic" rule computes
    that base when the sequence reaches s*L with factor 1."""
    ours = rope_inv_freq(D, base, {"rope_type": "ntk", "factor": s})
    written = (base * s ** (D / (D - 2))) ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    torch.testing.assert_close(ours, written, rtol=1e-12, atol=0)
    config = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D,
                         max_position_embeddings=L,
                         rope_parameters={"rope_theta": base, "rope_type": "dynamic", "factor": 1.0})
    dynamic, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=int(s * L))
    torch.testing.assert_close(ours.float(), dynamic, rtol=1e-6, atol=0)
    assert ours[0] == written[0] == 1.0 and math.isclose(ours[-1] * s, rope_inv_freq(D, base)[-1])


def test_check_rope_scaling_fills_yarn_defaults():
    out = check_rope_scaling({"rope_type": "yarn", "factor": 2,
                              "original_max_position_embeddings": 64})
    assert out == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                   "beta_fast": 32.0, "beta_slow": 1.0}
    assert rope_attention_factor(out) == pytest.approx(0.1 * math.log(2) + 1)
    assert rope_attention_factor(None) == 1.0


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
    assert config.context_length == 131072


def test_rope_angles_stay_accurate_at_large_positions():
    """Angles, cos and sin come from float64 and are rounded once: at positions beyond 100k a
    float32 computation of the angle is visibly off, lib's is not."""
    D, base, offset, T = 64, 10000.0, 131_000, 16
    rope = RotaryEmbedding(D, base)
    pos = torch.arange(offset, offset + T, dtype=torch.float64)
    inv64 = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ref = torch.outer(pos, inv64)                                  # float64 reference angles
    ref_cos = torch.cat((ref, ref), -1).cos()
    cos, sin = rope.cos_sin(T, offset)
    assert cos.dtype == torch.float32
    err = (cos.double() - ref_cos).abs().max().item()
    assert err < 1e-6                                              # one rounding to float32
    naive = torch.outer(pos.float(), inv64.float())                # the float32 way
    naive_err = (torch.cat((naive, naive), -1).cos().double() - ref_cos).abs().max().item()
    assert naive_err > 1e-3 > 1000 * err
    torch.testing.assert_close(sin.double(), torch.cat((ref, ref), -1).sin(), rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.angles(pos), ref.float())
