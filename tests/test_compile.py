"""torch.compile sees the training forward as one graph, and the compiled step computes what
eager computes (loss and every gradient), for the GPT-2-style, the Llama-style and the CPU
profile's model. The loss holds no per-step value check, so nothing forces a graph break."""
from __future__ import annotations

import pytest
import torch

from lib.model import GPT, GPTConfig

VARIANTS = {
    "gpt2-style": dict(),
    "llama-style": dict(positions="rope", n_kv_heads=2, norm="rmsnorm", ffn="swiglu"),
    "cpu-kernels": dict(positions="rope", cpu_kernels=True),
}


def _model(name: str) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig.tiny(vocab_size=11, context_length=16, d_model=32, n_layers=2,
                            n_heads=4, d_ff=64, **VARIANTS[name])
    return GPT(config).train()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(1))
    return ids, torch.roll(ids, -1, dims=1)


@pytest.mark.parametrize("name", VARIANTS)
def test_training_forward_has_no_graph_break(name):
    model = _model(name)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda i, t: model(i, t)[1])(*_batch())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name", ["llama-style", "cpu-kernels"])
def test_compiled_forward_and_backward_equal_eager(name):
    model = _model(name)
    ids, targets = _batch()
    _, loss = model(ids, targets)
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _, compiled_loss = compiled(ids, targets)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], msg=lambda m: f"{n}: {m}")
