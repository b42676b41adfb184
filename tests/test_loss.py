"""lib.loss (the written-out formulas) against torch's log_softmax and F.cross_entropy."""
import math

import pytest
import torch
import torch.nn.functional as F

from lib.loss import cross_entropy, log_softmax, perplexity

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 100.0, 1e4])
def test_log_softmax_matches_torch_even_for_huge_logits(dtype, scale):
    x = scale * torch.randn(4, 7, 33, dtype=dtype)
    ours = log_softmax(x)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, torch.log_softmax(x, dim=-1))
    torch.testing.assert_close(log_softmax(x, dim=1), torch.log_softmax(x, dim=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3), (2, 7, 11), (1, 1, 2)])
def test_cross_entropy_matches_torch_value_and_gradient(dtype, shape):
    g = torch.Generator().manual_seed(0)
    logits = (5 * torch.randn(shape, generator=g, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    logits_ref = logits.detach().clone().requires_grad_()
    loss = cross_entropy(logits, targets)
    ref = F.cross_entropy(logits_ref.reshape(-1, shape[-1]), targets.reshape(-1))
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, logits_ref.grad)


@pytest.mark.parametrize("ignore_index", [-100, -1, 0, 3])
def test_ignore_index_masks_like_torch(ignore_index):
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(3, 6, 5, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 5, (3, 6), generator=g)
    targets[0, :4] = ignore_index  # padding
    targets[2, 5] = ignore_index
    logits_ref = logits.detach().clone().requires_grad_()
    loss = cross_entropy(logits, targets, ignore_index=ignore_index)
    ref = F.cross_entropy(logits_ref.reshape(-1, 5), targets.reshape(-1), ignore_index=ignore_index)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, logits_ref.grad)
    assert (logits.grad[0, :4] == 0).all()  # ignored positions get no gradient


def test_default_ignore_index_is_torchs():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(5))
    targets = torch.tensor([1, -100, 6])
    torch.testing.assert_close(cross_entropy(logits, targets), F.cross_entropy(logits, targets))


def test_uniform_prediction_costs_log_v_and_has_perplexity_v():
    V = 65
    loss = cross_entropy(torch.zeros(4, 10, V), torch.randint(0, V, (4, 10)))
    torch.testing.assert_close(loss, torch.tensor(math.log(V)))
    torch.testing.assert_close(perplexity(loss), torch.tensor(float(V)))
    assert perplexity(math.log(V)) == pytest.approx(V)
    assert isinstance(perplexity(1.0), float)


def test_bfloat16_logits_are_scored_in_float32():
    logits = 4 * torch.randn(8, 100)
    targets = torch.randint(0, 100, (8,))
    loss = cross_entropy(logits.bfloat16(), targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.bfloat16().float(), targets))


@pytest.mark.parametrize("targets", [torch.zeros(0, dtype=torch.long), torch.full((2,), -100)])
def test_no_target_left_gives_nan_like_torch(targets):
    logits = torch.randn(len(targets), 5)
    assert torch.isnan(F.cross_entropy(logits, targets))
    assert torch.isnan(cross_entropy(logits, targets))


def test_loss_adds_no_graph_break():
    """No per-step value check: torch.compile sees the loss as one graph."""
    import torch._dynamo

    torch._dynamo.reset()
    logits = torch.randn(2, 8, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 8))
    targets[0, :3] = -100
    explained = torch._dynamo.explain(cross_entropy)(logits, targets)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
