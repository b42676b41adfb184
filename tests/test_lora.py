"""lib.lora: adapters start as a no-op, only they train, merging keeps the outputs, bad inputs are named."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lib.config import GPTConfig
from lib.lora import ATTENTION, FFN, SWIGLU, LoRALinear, apply_lora, lora_state_dict, merge_lora
from lib.model import GPT


def model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(vocab_size=31, d_model=32, n_layers=2, n_heads=4, d_ff=64, **overrides)).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 31, (2, 12), generator=torch.Generator().manual_seed(1))


def test_wrapped_model_starts_identical_and_only_adapters_train():
    m = model()
    before = m(ids())[0]
    names = apply_lora(m, ATTENTION, r=4, alpha=8.0)
    assert names == sorted(f"blocks.{i}.attn.{p}" for i in range(2) for p in ATTENTION)
    torch.testing.assert_close(m(ids())[0], before, rtol=0, atol=0)  # B = 0: exactly the same
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{x}" for n in names for x in "AB"}
    assert sum(p.numel() for p in m.parameters() if p.requires_grad) == 2 * 4 * 4 * (32 + 32)


def test_training_moves_only_adapters_and_merge_keeps_outputs():
    m = model()
    frozen = {n: p.detach().clone() for n, p in m.named_parameters()}
    apply_lora(m, ATTENTION + FFN, r=2, alpha=4.0)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    m.train()
    for _ in range(3):
        _, loss = m(ids(), ids())
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    for name, p in m.named_parameters():
        if "lora_" not in name:
            original = name.replace(".base.", ".")
            assert torch.equal(p, frozen[original]), f"{name} changed"
    unmerged = m(ids())[0]
    assert (unmerged - model()(ids())[0]).abs().max() > 1e-4  # the adapters did learn something
    merge_lora(m)
    assert not any(isinstance(x, LoRALinear) for x in m.modules())
    assert sorted(n for n, _ in m.named_parameters()) == sorted(frozen)
    torch.testing.assert_close(m(ids())[0], unmerged, rtol=1e-5, atol=1e-5)


def test_lora_linear_formula_and_state_dict():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    layer = LoRALinear(base, r=2, alpha=3.0)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(4, 6)
    expected = x @ (base.weight + 1.5 * layer.lora_B @ layer.lora_A).T + base.bias
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer.merged()(x), expected)
    assert (layer.in_features, layer.out_features) == (6, 5)
    m = model()
    apply_lora(m, ["blocks.1.attn.v_proj"], r=2)
    assert sorted(lora_state_dict(m)) == ["blocks.1.attn.v_proj.lora_A", "blocks.1.attn.v_proj.lora_B"]


def test_dropout_only_in_training():
    m = model()
    apply_lora(m, ["q_proj"], r=2, dropout=0.5)
    for layer in (x for x in m.modules() if isinstance(x, LoRALinear)):
        with torch.no_grad():
            layer.lora_B.normal_()
    m.eval()
    torch.testing.assert_close(m(ids())[0], m(ids())[0])


def test_bad_inputs():
    with pytest.raises(ValueError, match="targets must be a non-empty list of layer names"):
        apply_lora(model(), "q_proj")
    with pytest.raises(ValueError, match="targets"):
        apply_lora(model(), [])
    with pytest.raises(ValueError, match=r"target 'query' matches no layer.*'q_proj'"):
        apply_lora(model(), ["query"])
    with pytest.raises(ValueError, match=r"matches 'blocks.0.attn', a MultiHeadAttention"):
        apply_lora(model(), ["blocks.0.attn"])
    with pytest.raises(ValueError, match="tied head"):
        apply_lora(model(), ["lm_head"])
    apply_lora(model(tie_embeddings=False), ["lm_head"])  # an untied head is an ordinary layer
    with pytest.raises(ValueError, match=r"r must be an int with 1 <= r <= .* = 32, got 0"):
        apply_lora(model(), ATTENTION, r=0)
    with pytest.raises(ValueError, match="got 2.0"):
        apply_lora(model(), ATTENTION, r=2.0)
    with pytest.raises(ValueError, match="alpha"):
        apply_lora(model(), ATTENTION, alpha=0)
    with pytest.raises(ValueError, match="dropout"):
        apply_lora(model(), ATTENTION, dropout=1.0)
    with pytest.raises(ValueError, match="'w_gate' matches no layer"):
        apply_lora(model(), SWIGLU)
    assert len(apply_lora(model(ffn="swiglu"), SWIGLU)) == 6
    with pytest.raises(ValueError, match=r"min\(in_features, out_features\) = 5, got 6"):
        LoRALinear(nn.Linear(6, 5), r=6)
    with pytest.raises(TypeError, match="base"):
        LoRALinear(nn.Conv1d(3, 3, 1))
    m = model()
    apply_lora(m, ATTENTION)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(m, FFN)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge_lora(model())


def test_adapters_stay_float32_on_a_bfloat16_base():
    """On a bfloat16 base the adapters are float32, so an update below bfloat16's resolution
    survives an optimizer step (in bfloat16 it would round away); outputs keep the base dtype."""
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 8).to(torch.bfloat16), r=4, alpha=8.0)
    assert layer.base.weight.dtype == torch.bfloat16
    assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float32
    with torch.no_grad():
        layer.lora_B.fill_(1.0)
    step = 1e-3  # bfloat16 spaces numbers near 1 by 2**-7 = 0.0078: 1 + 1e-3 rounds back to 1
    assert torch.tensor(1.0, dtype=torch.bfloat16) + step == 1.0
    opt = torch.optim.SGD([layer.lora_B], lr=step)
    layer.lora_B.grad = -torch.ones_like(layer.lora_B)
    opt.step()
    torch.testing.assert_close(layer.lora_B, torch.full_like(layer.lora_B, 1 + step))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    expected = layer.base(x).float() + 2.0 * (x.float() @ layer.lora_A.T @ layer.lora_B.T)
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)
    y.float().sum().backward()  # gradients reach the float32 adapters
    assert layer.lora_A.grad.dtype == torch.float32 and layer.lora_A.grad.abs().sum() > 0
    merged = layer.merged()
    assert merged.weight.dtype == torch.bfloat16
    torch.testing.assert_close(merged(x).float(), y.float(), rtol=2e-2, atol=2e-2)


def test_apply_lora_on_a_bfloat16_model_trains_float32_adapters():
    m = model().to(torch.bfloat16)
    apply_lora(m, ATTENTION, r=2)
    trainable = [p for p in m.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    logits, loss = m(ids(), ids())
    assert logits.dtype == torch.bfloat16
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable)


def test_a_rejected_call_leaves_the_model_unchanged():
    """Every name and rank is checked before the first layer is wrapped or frozen."""
    m = model(tie_embeddings=False)
    with pytest.raises(ValueError, match="matches no layer"):
        apply_lora(m, ["q_proj", "query"])
    with pytest.raises(ValueError, match=r"min\(in_features, out_features\) = 31, got 32"):
        apply_lora(m, ["q_proj", "lm_head"], r=32)  # fits q_proj (32 x 32), not the head
    assert not any(isinstance(x, LoRALinear) for x in m.modules())
    assert all(p.requires_grad for p in m.parameters())


# ---- against peft, the library people fine-tune with ------------------------------------------

def _peft_copy(m: nn.Module, ours: nn.Module, targets, r: int, alpha: float, rslora: bool = False):
    """peft's LoRA on a copy of ``m`` (the model before apply_lora), adapters copied from ``ours``."""
    import copy

    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             use_rslora=rslora)
    theirs = peft.get_peft_model(copy.deepcopy(m), config)
    layers = {n: x for n, x in ours.named_modules() if isinstance(x, LoRALinear)}
    copied = 0
    with torch.no_grad():
        for name, module in theirs.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                mine = layers[name.removeprefix("base_model.model.")]
                module.lora_A["default"].weight.copy_(mine.lora_A)
                module.lora_B["default"].weight.copy_(mine.lora_B)
                copied += 1
    assert copied == len(layers) > 0
    return theirs


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_model_equals_peft(rslora):
    """apply_lora on attention + MLP gives the logits of peft's LoRA with the same A, B, r and alpha
    (rank-stabilised: peft's use_rslora with alpha' equals lib with alpha' * sqrt(r)); merging
    gives peft's merged weights."""
    r, alpha = 4, 6.0
    m = model()
    ours = model()
    apply_lora(ours, ATTENTION + FFN, r=r, alpha=alpha * r ** 0.5 if rslora else alpha)
    with torch.no_grad():
        for layer in (x for x in ours.modules() if isinstance(x, LoRALinear)):
            layer.lora_B.normal_()
    theirs = _peft_copy(m, ours, ATTENTION + FFN, r, alpha, rslora).eval()
    expected = theirs(ids())[0]
    assert (expected - m(ids())[0]).abs().max() > 1e-2   # the adapters change the output
    torch.testing.assert_close(ours(ids())[0], expected)
    merged, peft_merged = merge_lora(ours).state_dict(), theirs.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(peft_merged)
    for name, weight in merged.items():
        torch.testing.assert_close(weight, peft_merged[name])
