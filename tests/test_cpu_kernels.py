"""lib.cpu_kernels, the CPU speed-ups of the training step (benchmarks/cpu_kernels.py measures
them): the batched-matmul causal attention and the CPU attention forward must compute what the
written-out formula and torch's SDPA compute; the rotary embedding's kept tables must equal the
RoPE formula."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lib.attention import MultiHeadAttention, scaled_dot_product_attention
from lib.cpu_kernels import BMM_MAX_POSITIONS, CPUMultiHeadAttention, causal_attention_bmm
from lib.lora import apply_lora
from lib.model import GPT, GPTConfig
from lib.positional import RotaryEmbedding


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


def _mha(cls=MultiHeadAttention, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(0)
    return cls(32, 4, **kwargs).double()


@pytest.mark.parametrize("kwargs", [dict(), dict(n_kv_heads=2, bias=True),
                                    dict(rope=RotaryEmbedding(8), qk_norm=True),
                                    dict(n_kv_heads=1, rope=RotaryEmbedding(8))])
@pytest.mark.parametrize("T", [7, BMM_MAX_POSITIONS + 3])  # the bmm path, the fused kernel
def test_cpu_forward_equals_the_torch_kernel_path(kwargs, T):
    """The same weights (same seed) in MultiHeadAttention (F.scaled_dot_product_attention, held
    against references in test_attention.py) and CPUMultiHeadAttention: outputs and gradients."""
    mha = _mha(**kwargs)
    x = torch.randn(2, T, 32, dtype=torch.float64, requires_grad=True)
    reference = mha(x)
    g = torch.randn_like(reference)
    reference_grads = torch.autograd.grad(reference, [x, *mha.parameters()], g)
    mha = _mha(CPUMultiHeadAttention, **kwargs)
    assert mha._takes_cpu_path(x, 0, None) == (T <= BMM_MAX_POSITIONS)
    cpu = mha(x)
    cpu_grads = torch.autograd.grad(cpu, [x, *mha.parameters()], g)
    torch.testing.assert_close(cpu, reference)
    for a, b in zip(cpu_grads, reference_grads):  # each projection gets its own gradient back
        torch.testing.assert_close(a, b)


def test_config_cpu_kernels_keeps_the_weights_and_the_outputs_of_a_model():
    config = GPTConfig.tiny(11, positions="rope", context_length=32)
    torch.manual_seed(0)
    plain = GPT(config).double()
    torch.manual_seed(0)
    model = GPT(replace(config, cpu_kernels=True)).double()
    assert all(type(b.attn) is CPUMultiHeadAttention for b in model.blocks)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    ids = torch.randint(0, 11, (2, 32))
    torch.testing.assert_close(model(ids)[0], plain(ids)[0])
    cached = model.generate(ids[:, :5], 6, temperature=0.0)  # the cache takes the parent path
    assert torch.equal(cached, model.generate(ids[:, :5], 6, temperature=0.0, use_cache=False))


def test_hooks_and_lora_keep_the_separate_projections():
    """A forward hook on a projection, or a LoRA-wrapped projection, must still see its call:
    the stacked matmul is used only for three plain, hook-free nn.Linear layers."""
    mha = _mha(CPUMultiHeadAttention)
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    assert mha._takes_cpu_path(x, 0, None)
    seen = []
    handle = mha.k_proj.register_forward_hook(lambda module, inputs, out: seen.append(out))
    assert not mha._takes_cpu_path(x, 0, None)
    mha(x)
    assert len(seen) == 1
    handle.remove()
    assert mha._takes_cpu_path(x, 0, None) and not mha._takes_cpu_path(x, 3, None)
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2,
                          d_ff=32, cpu_kernels=True))
    apply_lora(model, r=2, targets=("q_proj", "v_proj"))
    assert not model.blocks[0].attn._takes_cpu_path(torch.randn(1, 4, 16), 0, None)


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
