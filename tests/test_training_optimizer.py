"""configure_optimizer: AdamW with decay on matrices only, and the kernel that ``fused`` asks for.

The kernel is checked by what it computes, not by a flag: in float32 torch's fused AdamW and its
default kernel round differently in the last bits (checked below), so a run equal bit for bit to
one of them used that one. In float64 the fused kernel equals the one-tensor-at-a-time loop, so it
computes the same formula (weight decay and its groups included)."""
from __future__ import annotations

import copy

import pytest
import torch

from lib.data import get_batch
from lib.model import GPT, GPTConfig
from lib.training import TrainConfig, configure_optimizer, train


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _tiny(**kwargs):
    return GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                         dropout=0.0, **kwargs))


def _run(model, optimizer, steps=4):
    for step in range(steps):
        x = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(step))
        _, loss = model(x, x.roll(-1, dims=1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _torch_adamw(model, **kernel):
    return torch.optim.AdamW(_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kernel)


@pytest.fixture(scope="module")
def references():
    """Four float32 steps of torch's AdamW, with its fused kernel and with its default one."""
    torch.manual_seed(0)
    start = _tiny()
    fused, default = copy.deepcopy(start), copy.deepcopy(start)
    out = {"start": start, "fused": _run(fused, _torch_adamw(fused, fused=True)),
           "default": _run(default, _torch_adamw(default))}
    differ = sum(not torch.equal(a, b) for a, b in zip(out["fused"], out["default"]))
    assert differ > len(out["fused"]) // 2  # the two kernels are distinguishable by their results
    return out


@pytest.mark.parametrize("fused, expected", [(True, "fused"), (False, "default"), (None, "default")])
def test_each_fused_setting_computes_what_that_torch_kernel_computes(references, fused, expected):
    """On a CPU: True = torch's fused AdamW, False and None (= fused on CUDA only) = its default."""
    model = copy.deepcopy(references["start"])
    ours = _run(model, configure_optimizer(model, lr=1e-2, weight_decay=0.1, fused_adamw=fused))
    assert all(torch.equal(a, b) for a, b in zip(ours, references[expected]))


def test_train_uses_the_kernel_its_config_names(references):
    """TrainConfig.fused_adamw reaches the optimizer train builds: one step of train() with it on
    and off equals one step of torch's fused and default AdamW."""
    data = torch.arange(200) * 7 % 11
    results = {}
    for fused in (True, False):
        model = copy.deepcopy(references["start"])
        config = TrainConfig(max_steps=1, batch_size=4, context_length=8, lr=1e-2, min_lr=1e-3,
                             warmup_steps=0, eval_interval=1, eval_batches=1, fused_adamw=fused)
        train(model, data, None, config, progress=False)
        results[fused] = [p.detach() for p in model.parameters()]
    for fused, kernel in ((True, dict(fused=True)), (False, {})):
        model = copy.deepcopy(references["start"])
        optimizer = _torch_adamw(model, **kernel)
        x, y = get_batch(data, 4, 8, generator=torch.Generator().manual_seed(config.seed))
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(results[fused], model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(results[True], results[False]))


def test_fused_steps_equal_the_single_tensor_loop():
    """Six steps of the fused kernel against torch's reference loop, in float64 so that rounding
    cannot hide a different formula (the weight decay and its groups included)."""
    torch.manual_seed(0)
    ours = _tiny().double()
    loop, start = copy.deepcopy(ours), copy.deepcopy(ours)
    opt_ours = configure_optimizer(ours, lr=1e-2, weight_decay=0.1, fused_adamw=True)
    opt_loop = torch.optim.AdamW(_groups(loop), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    final_ours, final_loop = _run(ours, opt_ours, 6), _run(loop, opt_loop, 6)
    for a, b in zip(final_ours, final_loop):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    moved = [(a - b).abs().max().item() for a, b in zip(final_ours, start.parameters())]
    assert min(moved) > 1e-4  # every parameter took real steps, so the comparison means something


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.0, weight_decay=0.1), "lr"),
    (dict(lr=1e-3, weight_decay=-1.0), "weight_decay"),
    (dict(lr=1e-3, weight_decay=0.1, eps=-1.0), "epsilon"),  # torch's AdamW's own check
])
def test_configure_optimizer_rejects_bad_values(kwargs, message):
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    with pytest.raises(ValueError, match=message):
        configure_optimizer(model, **kwargs)


def test_fused_adamw_must_be_none_or_a_bool():
    with pytest.raises(ValueError, match="fused_adamw must be True or False"):
        TrainConfig(fused_adamw="yes")
