"""lib.cpu_kernels, the CPU speed-ups of the training step (benchmarks/cpu_kernels.py measures
them): the batched-matmul causal attention and CPUMultiHeadAttention must compute what the
written-out formula, torch's SDPA and a reference built from torch and transformers compute; the rotary embedding's kept tables must equal the
RoPE formula."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lib.attention import KVCache, scaled_dot_product_attention
from lib.cpu_kernels import BMM_MAX_POSITIONS, CPUMultiHeadAttention, causal_attention_bmm
from lib.lora import apply_lora
from lib.model import GPT, GPTConfig
from lib.positional import RotaryEmbedding
from test_attention import reference_mha


@pytest.mark.parametrize("T", [1, 5, 64])
def test_causal_attention_bmm_equals_the_written_out_formula_and_torch(T):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, 8, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    ours = causal_attention_bmm(q, k, v)
    reference, _ = scaled_dot_product_attention(q, k, v, causal=True)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    g = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (q, k, v), g)
    ref_grads = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                    (q, k, v), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_causal_attention_bmm_first_query_sees_only_itself():
    q, k = torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2)
    v = torch.arange(4.0).view(1, 1, 4, 1).expand(1, 1, 4, 2)
    out = causal_attention_bmm(q, k, v)
    assert torch.equal(out[0, 0, 0], v[0, 0, 0])  # position 0 can only read its own value


def test_causal_attention_bmm_dropout_only_with_p():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    assert torch.equal(causal_attention_bmm(q, k, v, dropout_p=0.0),
                       causal_attention_bmm(q, k, v))
    assert not torch.allclose(causal_attention_bmm(q, k, v, dropout_p=0.5),
                              causal_attention_bmm(q, k, v))


def _mha(**kwargs) -> CPUMultiHeadAttention:
    torch.manual_seed(0)
    return CPUMultiHeadAttention(32, 4, **kwargs).double()


@pytest.mark.parametrize("kwargs", [dict(), dict(n_kv_heads=2, bias=True),
                                    dict(rope=RotaryEmbedding(8), qk_norm=True),
                                    dict(n_kv_heads=1, rope=RotaryEmbedding(8))])
@pytest.mark.parametrize("T", [1, 7, BMM_MAX_POSITIONS])
def test_cpu_attention_equals_the_reference_built_from_torch_and_transformers(kwargs, T):
    """CPUMultiHeadAttention against test_attention's reference_mha (heads split by hand,
    torch's SDPA, transformers' RoPE): outputs, and the gradients of the input and of every
    parameter (each projection gets its own back from the stacked matmul)."""
    mha = _mha(**kwargs)
    x = torch.randn(2, T, 32, dtype=torch.float64, requires_grad=True)
    reference, _ = reference_mha(mha, x)
    g = torch.randn_like(reference)
    reference_grads = torch.autograd.grad(reference, [x, *mha.parameters()], g)
    ours = mha(x)
    grads = torch.autograd.grad(ours, [x, *mha.parameters()], g)
    tolerance = dict(atol=1e-5, rtol=1e-5)  # transformers builds its RoPE tables in float32
    torch.testing.assert_close(ours, reference, **tolerance)
    for a, b in zip(grads, reference_grads):
        torch.testing.assert_close(a, b, **tolerance)


def test_cpu_attention_with_a_kv_cache_equals_the_whole_sequence_at_once():
    """Prompt, then one token at a time, then a chunk: every output equals the matching rows of
    the reference run over the whole sequence."""
    mha = _mha(n_kv_heads=2, rope=RotaryEmbedding(8), qk_norm=True).eval()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    reference, _ = reference_mha(mha, x)
    cache, pieces = KVCache(), [(0, 5), (5, 6), (6, 7), (7, 12)]
    outputs = [mha(x[:, a:b], offset=a, kv_cache=cache) for a, b in pieces]
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference, atol=1e-5, rtol=1e-5)


def test_config_cpu_kernels_keeps_the_weights_and_the_outputs_of_a_model():
    """A smoke test that the config swaps the module and nothing else (the attention itself is
    held against the reference above): same weights, same logits, cached generation agrees."""
    config = GPTConfig.tiny(11, positions="rope", context_length=32)
    torch.manual_seed(0)
    plain = GPT(config).double()
    torch.manual_seed(0)
    model = GPT(replace(config, cpu_kernels=True)).double()
    assert all(type(b.attn) is CPUMultiHeadAttention for b in model.blocks)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    ids = torch.randint(0, 11, (2, 32))
    torch.testing.assert_close(model(ids)[0], plain(ids)[0])
    cached = model.generate(ids[:, :5], 6, temperature=0.0)
    assert torch.equal(cached, model.generate(ids[:, :5], 6, temperature=0.0, use_cache=False))


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=4), "cpu_kernels=True needs window=None.*got window=4"),
    (dict(window=4, sinks=1), "cpu_kernels=True needs window=None.*got window=4"),
    (dict(context_length=BMM_MAX_POSITIONS + 1),
     f"context_length <= {BMM_MAX_POSITIONS}, got .*context_length={BMM_MAX_POSITIONS + 1}"),
])
def test_config_refuses_cpu_kernels_where_they_do_not_apply(kwargs, match):
    """What the bmm kernel does not compute (a window) or computes slower than torch's fused
    kernel (longer contexts) is refused when the config is built, not switched per call."""
    GPTConfig.tiny(11, context_length=BMM_MAX_POSITIONS, cpu_kernels=True)  # the limit itself
    with pytest.raises(ValueError, match=match):
        GPTConfig.tiny(11, **{"context_length": 32, **kwargs, "cpu_kernels": True})


def test_lora_refuses_a_model_with_cpu_kernels():
    """The stacked matmul reads the projections' weights without calling them, so adapters would
    be bypassed: apply_lora says so before changing anything."""
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2,
                          d_ff=32, cpu_kernels=True))
    with pytest.raises(ValueError, match="cpu_kernels=False"):
        apply_lora(model, r=2, targets=("q_proj", "v_proj"))
    assert all(p.requires_grad for p in model.parameters())


def test_rope_equals_the_rotation_formula_at_any_offset():
    """RotaryEmbedding (tables kept, or computed past them) against RoPE written here in float64:
    dims i and i + D/2 rotated by position * base^(-2i/D)."""
    D, base = 8, 500.0
    rope = RotaryEmbedding(D, base=base)
    x = torch.randn(2, 3, 7, D)
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    for offset in (0, 40, 5000):
        angles = torch.arange(offset, offset + 7, dtype=torch.float64)[:, None] * inv_freq
        cos, sin = angles.cos(), angles.sin()  # (T, D/2)
        x1, x2 = x.double()[..., :D // 2], x.double()[..., D // 2:]
        expected = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        torch.testing.assert_close(rope(x, offset).double(), expected, rtol=1e-5, atol=1e-5)
    assert math.isclose(rope.cos_sin(3, offset=2)[0][0, 0].item(), math.cos(2.0), rel_tol=1e-6)


def test_rope_tables_are_not_state():
    rope = RotaryEmbedding(8)
    rope.cos_sin(10)
    assert set(rope.state_dict()) == set()  # nothing saved in checkpoints
