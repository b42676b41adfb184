"""configure_optimizer's kernel choice: on a CPU (torch >= 2.4) and on CUDA the fused AdamW, one
kernel per step, which computes the same update as the one-tensor-at-a-time loop up to rounding;
on an older torch's CPU the multi-tensor ("foreach") kernel."""
from __future__ import annotations

import copy

import pytest
import torch

from lib import training
from lib.model import GPT, GPTConfig
from lib.training import configure_optimizer


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _tiny(**kwargs):
    return GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                         dropout=0.0, **kwargs))


def test_cpu_optimizer_is_fused_adamw():
    optimizer = configure_optimizer(_tiny(), lr=1e-3, weight_decay=0.1)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert training._CPU_FUSED_ADAMW  # the pinned torch has the fused CPU kernel
    assert optimizer.defaults["fused"] is True and not optimizer.defaults["foreach"]


def test_old_torch_falls_back_to_foreach(monkeypatch):
    monkeypatch.setattr(training, "_CPU_FUSED_ADAMW", False)
    optimizer = configure_optimizer(_tiny(), lr=1e-3, weight_decay=0.1)
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


def test_fused_steps_equal_the_single_tensor_loop():
    """Six steps of the fused kernel against torch's reference loop, in float64 so that rounding
    cannot hide a different formula (the weight decay and its groups included)."""
    torch.manual_seed(0)
    ours = _tiny().double()
    loop, start = copy.deepcopy(ours), copy.deepcopy(ours)
    opt_ours = configure_optimizer(ours, lr=1e-2, weight_decay=0.1)
    opt_loop = torch.optim.AdamW(_groups(loop), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for step in range(6):
        x = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(step))
        for model, opt in ((ours, opt_ours), (loop, opt_loop)):
            _, loss = model(x, x.roll(-1, dims=1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b in zip(ours.parameters(), loop.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    moved = [(a - b).abs().max().item() for a, b in zip(ours.parameters(), start.parameters())]
    assert min(moved) > 1e-4  # every parameter took real steps, so the comparison means something


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.0, weight_decay=0.1), "lr"),
    (dict(lr=1e-3, weight_decay=-1.0), "weight_decay"),
    (dict(lr=1e-3, weight_decay=0.1, eps=0.0), "eps"),
])
def test_configure_optimizer_rejects_bad_values(kwargs, message):
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    with pytest.raises(ValueError, match=message):
        configure_optimizer(model, **kwargs)
