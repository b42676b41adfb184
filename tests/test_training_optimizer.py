"""configure_optimizer's kernel choice: on the CPU the multi-tensor ("foreach") AdamW, which computes
the same numbers as the one-tensor-at-a-time loop with less overhead per step."""
from __future__ import annotations

import copy

import pytest
import torch

from lib.model import GPT, GPTConfig
from lib.training import configure_optimizer


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def test_cpu_optimizer_is_foreach_adamw():
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    optimizer = configure_optimizer(model, lr=1e-3, weight_decay=0.1)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


def test_foreach_steps_are_bit_identical_to_the_single_tensor_loop():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                       dropout=0.0)
    ours = GPT(config)
    loop = copy.deepcopy(ours)
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
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.0, weight_decay=0.1), "lr"),
    (dict(lr=1e-3, weight_decay=-1.0), "weight_decay"),
    (dict(lr=1e-3, weight_decay=0.1, eps=0.0), "eps"),
])
def test_configure_optimizer_rejects_bad_values(kwargs, message):
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    with pytest.raises(ValueError, match=message):
        configure_optimizer(model, **kwargs)
