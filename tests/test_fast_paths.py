"""The CPU fast paths of the training step (benchmarks/cpu_kernels.py measures their speed): the
batched-matmul causal attention, the stacked q/k/v projection, the rotary embedding's cached
tables. Each must compute what the written-out path computes."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lib.attention import (SHORT_SEQUENCE, MultiHeadAttention, causal_attention_bmm,
                           scaled_dot_product_attention)
from lib.lora import apply_lora
from lib.model import GPT, GPTConfig
from lib.positional import RotaryEmbedding


@pytest.mark.parametrize("T", [1, 5, 64])
def test_causal_attention_bmm_equals_the_written_out_formula(T):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ours = causal_attention_bmm(q, k, v)
    reference, _ = scaled_dot_product_attention(q, k, v, causal=True)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    g = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (q, k, v), g)
    ref_grads = torch.autograd.grad(reference, (q, k, v), g)
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
    assert torch.equal(causal_attention_bmm(q, k, v, dropout_p=0.0), causal_attention_bmm(q, k, v))
    assert not torch.allclose(causal_attention_bmm(q, k, v, dropout_p=0.5), causal_attention_bmm(q, k, v))


def test_causal_attention_bmm_rejects_mismatched_shapes():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="one shape"):
        causal_attention_bmm(q, torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    with pytest.raises(ValueError, match="one shape"):
        causal_attention_bmm(q[0], q[0], q[0])


def _mha(**kwargs) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(32, 4, **kwargs).double()


@pytest.mark.parametrize("kwargs", [dict(), dict(n_kv_heads=2, bias=True),
                                    dict(rope=RotaryEmbedding(8), qk_norm=True),
                                    dict(n_kv_heads=1, rope=RotaryEmbedding(8))])
@pytest.mark.parametrize("T", [7, SHORT_SEQUENCE + 3])  # the bmm path and the fused kernel
def test_fast_path_equals_explicit_path(kwargs, T):
    mha = _mha(**kwargs)
    x = torch.randn(2, T, 32, dtype=torch.float64, requires_grad=True)
    fast, _ = mha(x)
    g = torch.randn_like(fast)
    fast_grads = torch.autograd.grad(fast, [x, *mha.parameters()], g)
    mha.fast = False
    explicit, _ = mha(x)
    explicit_grads = torch.autograd.grad(explicit, [x, *mha.parameters()], g)
    torch.testing.assert_close(fast, explicit)
    for a, b in zip(fast_grads, explicit_grads):  # each projection gets its own gradient back
        torch.testing.assert_close(a, b)


def test_hooks_and_lora_keep_the_separate_projections():
    """A forward hook on a projection, or a LoRA-wrapped projection, must still see its call: the
    stacked matmul is used only for three plain, hook-free nn.Linear layers."""
    mha = _mha()
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    assert mha._stackable()
    seen = []
    handle = mha.k_proj.register_forward_hook(lambda module, inputs, output: seen.append(output))
    assert not mha._stackable()
    mha(x)
    assert len(seen) == 1
    handle.remove()
    assert mha._stackable()
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    apply_lora(model, r=2, targets=("q_proj", "v_proj"))
    assert not model.blocks[0].attn._stackable()


def test_rope_tables_equal_a_fresh_computation_and_grow():
    rope = RotaryEmbedding(8, base=500.0)
    first = rope.cos_sin(5)
    later = rope.cos_sin(7, offset=40)  # past the first table: it grows
    assert len(rope._tables[(torch.device("cpu"), torch.float32)][0]) >= 47
    for (cos, sin), (T, offset) in ((first, (5, 0)), (later, (7, 40))):
        angles = rope._angles64(torch.arange(offset, offset + T))
        angles = torch.cat((angles, angles), dim=-1)
        assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
    cos64, _ = rope.cos_sin(3, offset=2, dtype=torch.float64)  # one table per dtype
    assert cos64.dtype == torch.float64
    assert torch.equal(cos64.float(), rope.cos_sin(3, offset=2)[0])
    assert math.isclose(cos64[0, 0].item(), math.cos(2.0))


def test_rope_tables_are_not_state():
    rope = RotaryEmbedding(8)
    rope.cos_sin(10)
    assert set(rope.state_dict()) == set()  # nothing saved in checkpoints
