"""lib.attention against torch's attention, plus the properties cached decoding relies on.

References: torch's ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention``, masks from
``torch.tril``/``triu``, and for RoPE variants transformers' ``LlamaRotaryEmbedding`` +
``apply_rotary_pos_emb`` (not lib's own rotation)."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lib.attention
from lib.attention import (KVCache, MultiHeadAttention, attention_mask, attention_weights,
                           scaled_dot_product_attention)
from lib.positional import RotaryEmbedding

os.environ.setdefault("HF_HUB_OFFLINE", "1")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

DTYPES = [torch.float32, torch.float64]


def qkv(B, H, H_kv, T_q, T_k, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_q, D, generator=g, dtype=dtype)
    k = torch.randn(B, H_kv, T_k, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_kv, T_k, D, generator=g, dtype=dtype)
    return q, k, v


def tril(T_q, T_k, window=None, sinks=0):
    """The mask from torch.tril/triu, independent of lib: the queries are the last T_q; with a
    window, the first ``sinks`` keys stay visible (to queries at or after them)."""
    ones = torch.ones(T_q, T_k, dtype=torch.bool)
    mask = ones.tril(T_k - T_q)
    if window is not None:
        sink = torch.zeros(T_q, T_k, dtype=torch.bool)
        sink[:, :sinks] = True
        mask = mask & (ones.triu(T_k - T_q - window + 1) | sink)
    return mask


# ---------------------------------------------------------------- masks

def test_attention_mask_is_torch_tril():
    for T_q, T_k in [(5, 5), (1, 9), (3, 9), (0, 0), (0, 4)]:
        m = attention_mask(T_q, T_k)
        assert m.dtype == torch.bool and m.shape == (T_q, T_k)
        assert torch.equal(m, tril(T_q, T_k))


def test_window_mask_sees_exactly_the_last_w_positions():
    m = attention_mask(8, 8, window=3)
    for i in range(8):
        seen = m[i].nonzero().flatten().tolist()
        assert seen == list(range(max(0, i - 2), i + 1))
    assert torch.equal(attention_mask(2, 8, window=3), m[6:])
    assert torch.equal(attention_mask(8, 8, window=100), tril(8, 8))


def test_sinks_mask_adds_the_first_positions_to_every_window():
    for T_q, T_k in [(9, 9), (3, 9), (1, 9)]:
        assert torch.equal(attention_mask(T_q, T_k, window=3, sinks=2), tril(T_q, T_k, 3, 2))
    assert not torch.equal(tril(9, 9, 3, 2), tril(9, 9, 3))  # the sinks change the mask


# ---------------------------------------------------------------- scaled dot-product attention

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,H_kv,T,D", [(1, 1, 1, 1, 4), (2, 4, 4, 7, 8), (3, 8, 2, 16, 16),
                                          (2, 6, 1, 5, 32)])
def test_sdpa_matches_torch_causal(dtype, B, H, H_kv, T, D):
    q, k, v = qkv(B, H, H_kv, T, T, D, dtype)
    out, weights = scaled_dot_product_attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != H_kv)
    torch.testing.assert_close(out, ref)
    assert weights.shape == (B, H, T, T)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, T, dtype=dtype))
    assert (weights[..., ~tril(T, T)] == 0).all()  # nothing flows from the future


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2), (4, 1)])
def test_sdpa_matches_torch_with_a_boolean_mask(dtype, H, H_kv):
    B, T_q, T_k, D = 2, 6, 9, 8
    q, k, v = qkv(B, H, H_kv, T_q, T_k, D, dtype, seed=1)
    mask = torch.rand(B, 1, T_q, T_k, generator=torch.Generator().manual_seed(2)) < 0.6
    mask[..., 0] = True  # every query keeps at least one key
    out, weights = scaled_dot_product_attention(q, k, v, mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != H_kv)
    torch.testing.assert_close(out, ref)
    assert (weights.masked_select(~mask.expand_as(weights)) == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_causal_with_fewer_queries_aligns_to_the_last_key(dtype):
    q, k, v = qkv(2, 4, 2, 3, 10, 8, dtype, seed=3)
    out, _ = scaled_dot_product_attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=tril(3, 10), enable_gqa=True)
    torch.testing.assert_close(out, ref)


def test_sdpa_without_mask_and_without_heads_dimension():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(5, 8, generator=g) for _ in range(3))  # (T, D): no batch, no heads
    out, weights = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q[None], k[None], v[None])[0])
    torch.testing.assert_close(weights, torch.softmax(q @ k.T / 8 ** 0.5, dim=-1))


def test_mha_shares_kv_heads_without_copying_them(monkeypatch):
    """Grouped-query decoding hands the cache's own k and v to torch's kernel (enable_gqa),
    not a repeated copy of the whole cache."""
    mha = random_mha(n_kv_heads=1)
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    cache = KVCache()
    mha(x[:, :8], 0, cache)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((k.data_ptr(), k.size(1), kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(lib.attention.F, "scaled_dot_product_attention", spy)
    step = mha(x[:, 8:], 8, cache)
    monkeypatch.undo()
    assert seen == [(cache.k.data_ptr(), 1, True)]
    torch.testing.assert_close(step, mha(x)[:, 8:])


# ---------------------------------------------------------------- multi-head attention

def mapped_torch_mha(mha: MultiHeadAttention, bias: bool) -> nn.MultiheadAttention:
    """nn.MultiheadAttention carrying the same weights as ``mha`` (packed q/k/v projection)."""
    ref = nn.MultiheadAttention(mha.q_proj.in_features, mha.n_heads, bias=bias, batch_first=True,
                                dtype=mha.q_proj.weight.dtype)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([mha.q_proj.weight, mha.k_proj.weight,
                                            mha.v_proj.weight]))
        ref.out_proj.weight.copy_(mha.out_proj.weight)
        if bias:
            ref.in_proj_bias.copy_(torch.cat([mha.q_proj.bias, mha.k_proj.bias,
                                              mha.v_proj.bias]))
            ref.out_proj.bias.copy_(mha.out_proj.bias)
    return ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("B,T,d_model,n_heads", [(1, 1, 8, 2), (2, 7, 32, 4)])
def test_mha_matches_torch_multihead_attention(dtype, bias, B, T, d_model, n_heads):
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model, n_heads, bias=bias).to(dtype)
    if bias:  # nn.Linear starts biases at random already; make sure they matter
        assert mha.q_proj.bias.abs().sum() > 0
    ref = mapped_torch_mha(mha, bias)
    x = torch.randn(B, T, d_model, dtype=dtype)
    ref_out, ref_w = ref(x, x, x, attn_mask=~tril(T, T), need_weights=True,
                         average_attn_weights=False)
    torch.testing.assert_close(mha(x), ref_out)
    torch.testing.assert_close(attention_weights(mha, x), ref_w)


def random_mha(seed=0, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(seed)
    kwargs.setdefault("d_model", 32)
    kwargs.setdefault("n_heads", 4)
    return MultiHeadAttention(**kwargs).double()


def hf_rope(q, k, base):
    """q, k ``(B, H, T, D)`` rotated by transformers' Llama RoPE (positions 0..T-1)."""
    pytest.importorskip("transformers", reason="transformers is a development requirement")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    B, H, T, D = q.shape
    config = LlamaConfig(hidden_size=D * H, num_attention_heads=H, num_key_value_heads=H,
                         head_dim=D, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": base})
    rotary = LlamaRotaryEmbedding(config).double()
    cos, sin = rotary(q, torch.arange(T)[None])
    return apply_rotary_pos_emb(q, k, cos.double(), sin.double())


def reference_mha(mha: MultiHeadAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and weights of ``mha`` on ``x`` without lib.attention's code: heads split by hand,
    the mask from torch.tril/triu, key/value heads repeated, RoPE by transformers, torch's SDPA;
    weights by softmax."""
    B, T, C = x.shape
    H, H_kv, D = mha.n_heads, mha.n_kv_heads, mha.head_dim
    q = mha.q_proj(x).view(B, T, H, D).transpose(1, 2)
    k = mha.k_proj(x).view(B, T, H_kv, D).transpose(1, 2).repeat_interleave(H // H_kv, dim=1)
    v = mha.v_proj(x).view(B, T, H_kv, D).transpose(1, 2).repeat_interleave(H // H_kv, dim=1)
    if mha.q_norm is not None:
        q, k = (F.rms_norm(t, (D,), norm.weight, norm.eps)
                for t, norm in ((q, mha.q_norm), (k, mha.k_norm)))
    if mha.rope is not None:
        q, k = hf_rope(q, k, mha.rope.base)
    mask = tril(T, T, mha.window, mha.sinks)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = (q @ k.transpose(-2, -1) / D ** 0.5).masked_fill(~mask, float("-inf"))
    return mha.out_proj(y.transpose(1, 2).reshape(B, T, C)), scores.softmax(-1)


VARIANTS = [
    dict(),
    dict(n_kv_heads=2),
    dict(n_kv_heads=1),
    dict(window=3),
    dict(rope=RotaryEmbedding(8)),
    dict(qk_norm=True, rope=RotaryEmbedding(8)),
    dict(n_kv_heads=2, rope=RotaryEmbedding(8, base=500.0), window=4, sinks=2, bias=True),
]


@pytest.mark.parametrize("kwargs", VARIANTS)
def test_mha_and_its_weights_equal_references_on_hand_split_heads(kwargs):
    """The module (torch's kernel) and attention_weights (the written-out formula) against a
    reference built without lib.attention; RoPE at float32-table precision."""
    mha = random_mha(**kwargs)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    ref_out, ref_w = reference_mha(mha, x)
    tol = dict(rtol=1e-5, atol=1e-6) if mha.rope is not None else {}
    torch.testing.assert_close(mha(x), ref_out, **tol)
    torch.testing.assert_close(attention_weights(mha, x), ref_w, **tol)


@pytest.mark.parametrize("kwargs", VARIANTS)
def test_outputs_at_t_do_not_depend_on_later_tokens(kwargs):
    mha = random_mha(**kwargs)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    y = x.clone()
    y[:, 6:] = torch.randn(2, 4, 32, dtype=torch.float64)  # change tokens 6..9
    out_x, out_y = mha(x), mha(y)
    torch.testing.assert_close(out_x[:, :6], out_y[:, :6], rtol=0, atol=1e-12)
    assert not torch.allclose(out_x[:, 6:], out_y[:, 6:])


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_equals_mha_whose_kv_heads_are_copied_per_group(n_kv_heads):
    gqa = random_mha(seed=5, n_heads=8, n_kv_heads=n_kv_heads)
    mha = random_mha(seed=6, n_heads=8)
    D, group = gqa.head_dim, 8 // n_kv_heads
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.out_proj.weight.copy_(gqa.out_proj.weight)
        for name in ("k_proj", "v_proj"):
            w = getattr(gqa, name).weight.view(n_kv_heads, D, 32)  # one (D, C) block per head
            getattr(mha, name).weight.copy_(w.repeat_interleave(group, dim=0).reshape(8 * D, 32))
    if n_kv_heads < 8:
        assert sum(p.numel() for p in gqa.parameters()) < sum(p.numel() for p in mha.parameters())
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(gqa(x), mha(x))
    torch.testing.assert_close(attention_weights(gqa, x), attention_weights(mha, x))


def test_rope_scores_depend_only_on_relative_position():
    mha = random_mha(rope=RotaryEmbedding(8))
    x = torch.randn(1, 2, 32, dtype=torch.float64)  # a query token and a key token
    q = mha.q_proj(x[:, :1]).view(1, 1, 4, 8).transpose(1, 2)  # (1, H, 1, D)
    k = mha.k_proj(x[:, 1:]).view(1, 1, 4, 8).transpose(1, 2)

    def score(m, n):  # q at position m, k at position n
        return (mha.rope(q, offset=m) * mha.rope(k, offset=n)).sum(-1)

    for m, n in [(5, 2), (9, 9), (3, 7)]:
        for shift in (1, 17, 250):
            # to float32 precision: RotaryEmbedding keeps its cos/sin tables in float32
            torch.testing.assert_close(score(m + shift, n + shift), score(m, n),
                                       rtol=1e-5, atol=1e-6)
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_rope_with_a_window_makes_a_periodic_input_give_periodic_outputs():
    """With a window w and relative positions, tokens t and t+p of a p-periodic input (both at
    least w-1 tokens in) see the same keys at the same distances, so their outputs match."""
    mha = random_mha(rope=RotaryEmbedding(8), window=4)
    pattern = torch.randn(1, 5, 32, dtype=torch.float64)
    x = pattern.repeat(1, 4, 1)  # (1, 20, 32), period 5
    out = mha(x)
    torch.testing.assert_close(out[:, 3:15], out[:, 8:20])
    # absolute positions (added to the input) break the equality, as they should
    absolute = x + 0.1 * torch.randn(1, 20, 32, dtype=torch.float64)
    out_abs = random_mha(window=4)(absolute)
    assert not torch.allclose(out_abs[:, 3:15], out_abs[:, 8:20])


@pytest.mark.parametrize("kwargs", VARIANTS + [dict(window=3, sinks=1)])
def test_kv_cache_decoding_equals_full_recomputation(kwargs):
    mha = random_mha(**kwargs)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    full = mha(x)
    cache = KVCache()
    pieces = []
    for start, end in [(0, 5), (5, 6), (6, 7), (7, 10), (10, 11), (11, 12)]:  # prompt, a chunk
        pieces.append(mha(x[:, start:end], start, cache))
        assert cache.length == end
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)
    assert cache.k.shape == (2, mha.n_kv_heads, 12, 8)  # the cache holds H_kv heads, not H
    cache.reset()
    assert cache.length == 0
