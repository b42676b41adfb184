"""lib.feedforward: GELU against F.gelu, the MLP and SwiGLU against their formulas."""
import pytest
import torch
import torch.nn.functional as F

from lib.feedforward import GELU, FeedForward, SwiGLU, gelu

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(7,), (2, 4, 33)])
def test_gelu_matches_torch(dtype, approximate, shape):
    x = 4 * torch.randn(shape, dtype=dtype)
    torch.testing.assert_close(gelu(x, approximate), F.gelu(x, approximate=approximate))


def test_gelu_module_applies_its_approximation():
    x = 4 * torch.randn(3, 5, dtype=torch.float64)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(GELU(approximate)(x), gelu(x, approximate))
    assert not torch.allclose(GELU("tanh")(x), GELU("none")(x))


def test_gelu_at_extremes():
    x = torch.tensor([-50.0, -10.0, 0.0, 10.0, 50.0], dtype=torch.float64)
    for approximate in ("none", "tanh"):
        y = gelu(x, approximate)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, F.gelu(x, approximate=approximate))


def test_tanh_approximation_is_close_to_exact():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    assert (gelu(x, "tanh") - gelu(x)).abs().max() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("bias", [False, True])
def test_feedforward_is_fc_out_act_fc_in(dtype, activation, bias):
    torch.manual_seed(0)
    ffn = FeedForward(16, 64, activation=activation, bias=bias).to(dtype)
    x = torch.randn(2, 5, 16, dtype=dtype)
    h = F.linear(x, ffn.fc_in.weight, ffn.fc_in.bias)
    h = F.relu(h) if activation == "relu" else F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")
    torch.testing.assert_close(ffn(x), F.linear(h, ffn.fc_out.weight, ffn.fc_out.bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_is_gated_silu(dtype):
    torch.manual_seed(1)
    ffn = SwiGLU(16, 40).to(dtype)
    x = torch.randn(3, 4, 16, dtype=dtype)
    gate, up = x @ ffn.w_gate.weight.T, x @ ffn.w_up.weight.T
    expected = (gate * torch.sigmoid(gate) * up) @ ffn.w_down.weight.T
    torch.testing.assert_close(ffn(x), expected)
    assert sum(p.numel() for p in ffn.parameters()) == 3 * 16 * 40


@pytest.mark.parametrize("ffn", [FeedForward(8, 32), SwiGLU(8, 24)])
def test_hook_on_act_captures_hidden_activations(ffn):
    captured = []
    handle = ffn.act.register_forward_hook(lambda m, inp, out: captured.append(out))
    ffn(torch.randn(2, 3, 8))
    handle.remove()
    assert len(captured) == 1 and captured[0].shape[:2] == (2, 3)
    assert captured[0].shape[-1] == (32 if isinstance(ffn, FeedForward) else 24)
