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
    with pytest.raises(TypeError, match="model"):
        apply_lora("gpt", ATTENTION)
    with pytest.raises(TypeError, match="targets"):
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
    with pytest.raises(ValueError, match="r must be"):
        apply_lora(model(), ATTENTION, r=0)
    with pytest.raises(ValueError, match="alpha"):
        apply_lora(model(), ATTENTION, alpha=0)
    with pytest.raises(ValueError, match="dropout"):
        apply_lora(model(), ATTENTION, dropout=1.0)
    with pytest.raises(ValueError, match="'w_gate' matches no layer"):
        apply_lora(model(), SWIGLU)
    assert len(apply_lora(model(ffn="swiglu"), SWIGLU)) == 6
    with pytest.raises(ValueError, match=r"r must be <= min\(in_features, out_features\) = 5"):
        LoRALinear(nn.Linear(6, 5), r=6)
    with pytest.raises(TypeError, match="base"):
        LoRALinear(nn.Conv1d(3, 3, 1))
    m = model()
    apply_lora(m, ATTENTION)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(m, FFN)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge_lora(model())
    with pytest.raises(TypeError, match="model"):
        merge_lora(None)
