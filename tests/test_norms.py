"""lib.norms against nn.LayerNorm and nn.RMSNorm."""
import pytest
import torch
from torch import nn

from lib.norms import LayerNorm, RMSNorm

DTYPES = [torch.float32, torch.float64]
SHAPES = [(3, 8), (2, 5, 16), (4, 1, 7), (2, 3, 4, 64)]


def randomise(*modules: nn.Module, seed: int = 0) -> None:
    """Give every parameter the same random values in each module (default init is all ones/zeros)."""
    g = torch.Generator().manual_seed(seed)
    params = [dict(m.named_parameters()) for m in modules]
    with torch.no_grad():
        for name, p in params[0].items():
            value = torch.randn(p.shape, generator=g, dtype=p.dtype)
            for ps in params:
                ps[name].copy_(value)


@pytest.mark.parametrize("fused", [False, True], ids=["written-out", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_layernorm_matches_torch(fused, dtype, shape, bias, eps):
    d = shape[-1]
    ours = LayerNorm(d, eps=eps, bias=bias).to(dtype)
    ours.fused = fused
    ref = nn.LayerNorm(d, eps=eps, bias=bias, dtype=dtype)
    randomise(ours, ref)
    x = (3 * torch.randn(shape, dtype=dtype) + 2).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = ours(x), ref(x_ref)
    torch.testing.assert_close(out, out_ref)
    grad = torch.randn(shape, dtype=dtype)
    out.backward(grad)
    out_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("fused", [False, True], ids=["written-out", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_matches_torch(fused, dtype, shape, eps):
    d = shape[-1]
    ours = RMSNorm(d, eps=eps).to(dtype)
    ours.fused = fused
    ref = nn.RMSNorm(d, eps=eps, dtype=dtype)
    randomise(ours, ref, seed=1)
    x = 5 * torch.randn(shape, dtype=dtype)
    torch.testing.assert_close(ours(x), ref(x))


def explicit(norm):
    norm.fused = False
    return norm


def test_fused_and_written_out_paths_agree():
    x = 3 * torch.randn(4, 5, 24) + 1
    for norm in (LayerNorm(24), RMSNorm(24)):
        randomise(norm, seed=2)
        fused = norm(x)
        torch.testing.assert_close(explicit(norm)(x), fused)


def test_layernorm_output_has_zero_mean_and_unit_variance():
    x = 10 * torch.randn(6, 32, dtype=torch.float64) - 4
    y = explicit(LayerNorm(32).double())(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(6, dtype=torch.float64), rtol=1e-4, atol=1e-4)


def test_rmsnorm_output_has_unit_root_mean_square_and_keeps_the_mean_direction():
    x = 10 * torch.randn(6, 32, dtype=torch.float64) + 3
    y = explicit(RMSNorm(32).double())(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(6, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y * x.pow(2).mean(-1, keepdim=True).sqrt(), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", [LayerNorm(16), RMSNorm(16)])
def test_half_precision_input_keeps_its_dtype_and_accuracy(norm):
    """float32 weights, bfloat16 input: the written-out path computes the statistics in float32."""
    x = 100 + torch.randn(4, 16)  # a large mean is where low-precision statistics go wrong
    y = norm(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), norm(x.bfloat16().float()), rtol=1e-2, atol=1e-2)


def test_layernorm_without_bias_has_no_bias_parameter():
    assert [n for n, _ in LayerNorm(8, bias=False).named_parameters()] == ["weight"]
    assert [n for n, _ in RMSNorm(8).named_parameters()] == ["weight"]


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_bad_arguments_are_clear_errors(cls):
    with pytest.raises(ValueError, match="d must"):
        cls(0)
    with pytest.raises(ValueError, match="eps must"):
        cls(8, eps=0.0)
