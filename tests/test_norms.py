"""lib.norms: the written-out formulas (layer_norm, rms_norm) against nn.LayerNorm and
nn.RMSNorm, and the layers (torch's kernels) with their parameters and shapes."""
import pytest
import torch
from torch import nn

from lib.norms import LayerNorm, RMSNorm, layer_norm, rms_norm

DTYPES = [torch.float32, torch.float64]
SHAPES = [(3, 8), (2, 5, 16), (2, 3, 4, 64)]


def randomise(*modules: nn.Module, seed: int = 0) -> None:
    """Give every parameter the same random values in each module (default init is all ones/zeros)."""
    g = torch.Generator().manual_seed(seed)
    params = [dict(m.named_parameters()) for m in modules]
    with torch.no_grad():
        for name, p in params[0].items():
            value = torch.randn(p.shape, generator=g, dtype=p.dtype)
            for ps in params:
                ps[name].copy_(value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_layer_norm_formula_matches_torch(dtype, shape, bias, eps):
    d = shape[-1]
    ref = nn.LayerNorm(d, eps=eps, bias=bias, dtype=dtype)
    randomise(ref)
    weight = ref.weight.detach().clone().requires_grad_()
    x = (3 * torch.randn(shape, dtype=dtype) + 2).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = layer_norm(x, weight, ref.bias, eps), ref(x_ref)
    torch.testing.assert_close(out, out_ref)
    grad = torch.randn(shape, dtype=dtype)
    out.backward(grad)
    out_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(weight.grad, ref.weight.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rms_norm_formula_matches_torch(dtype, shape, eps):
    d = shape[-1]
    ref = nn.RMSNorm(d, eps=eps, dtype=dtype)
    randomise(ref, seed=1)
    x = 5 * torch.randn(shape, dtype=dtype)
    torch.testing.assert_close(rms_norm(x, ref.weight, eps), ref(x))


def test_layers_compute_the_formulas_with_their_own_parameters():
    """LayerNorm/RMSNorm (torch's kernels) hold weight, bias and eps and apply them: compared
    with the written-out formula on random parameters and a non-default eps."""
    x = 3 * torch.randn(4, 5, 24, dtype=torch.float64) + 1
    ln, rms = LayerNorm(24, eps=1e-2).double(), RMSNorm(24, eps=1e-2).double()
    randomise(ln, seed=2)
    randomise(rms, seed=3)
    torch.testing.assert_close(ln(x), layer_norm(x, ln.weight, ln.bias, 1e-2))
    torch.testing.assert_close(rms(x), rms_norm(x, rms.weight, 1e-2))
    assert not torch.allclose(ln(x), layer_norm(x, ln.weight, None, 1e-2))  # the bias is used


def test_layer_norm_output_has_zero_mean_and_unit_variance():
    x = 10 * torch.randn(6, 32, dtype=torch.float64) - 4
    y = layer_norm(x, torch.ones(32, dtype=torch.float64))
    torch.testing.assert_close(y.mean(-1), torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(6, dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)


def test_rms_norm_output_has_unit_root_mean_square_and_keeps_the_direction():
    x = 10 * torch.randn(6, 32, dtype=torch.float64) + 3
    y = rms_norm(x, torch.ones(32, dtype=torch.float64))
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(6, dtype=torch.float64), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(y * x.pow(2).mean(-1, keepdim=True).sqrt(), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("formula", [layer_norm, rms_norm])
def test_formulas_keep_half_precision_input_dtype_with_float32_statistics(formula):
    """float32 weights, bfloat16 input: statistics in float32, the result in bfloat16."""
    x = 100 + torch.randn(4, 16)  # a large mean is where low-precision statistics go wrong
    y = formula(x.bfloat16(), torch.ones(16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), formula(x.bfloat16().float(), torch.ones(16)),
                               rtol=1e-2, atol=1e-2)


def test_layernorm_without_bias_has_no_bias_parameter():
    assert [n for n, _ in LayerNorm(8, bias=False).named_parameters()] == ["weight"]
    assert [n for n, _ in RMSNorm(8).named_parameters()] == ["weight"]
