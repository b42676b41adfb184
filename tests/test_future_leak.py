"""No future leak: changing a later token must leave every earlier output unchanged.

The check chapter 04 demonstrates, run on the library: the attention function, the attention
module (fused and written-out paths) and the whole model. A transposed mask fails it.
"""
import pytest
import torch

from lib.cpu_kernels import CPUMultiHeadAttention
from lib.attention import MultiHeadAttention, attention_mask, scaled_dot_product_attention
from lib.model import GPT, GPTConfig

T, CHANGED = 7, 5  # sequence length; the position whose token we change


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one thread avoids thread start-up costs on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _change_one_position(x: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A copy of ``x`` (B, T, ...) with position CHANGED replaced by fresh random values."""
    y = x.clone()
    g = torch.Generator().manual_seed(seed)
    y[:, CHANGED] = torch.randn(y[:, CHANGED].shape, generator=g, dtype=x.dtype)
    return y


def _assert_no_leak(before: torch.Tensor, after: torch.Tensor) -> None:
    """Outputs before CHANGED are equal; the output at CHANGED did change (the test has teeth)."""
    torch.testing.assert_close(after[:, :CHANGED], before[:, :CHANGED])
    assert (after[:, CHANGED] - before[:, CHANGED]).abs().max() > 1e-3


def _project(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(x.shape[-1], 8, generator=g, dtype=x.dtype) / x.shape[-1] ** 0.5 for _ in range(3)]
    return x @ w[0], x @ w[1], x @ w[2]


@pytest.mark.parametrize("how", ["causal=True", "mask=attention_mask"])
def test_sdpa_earlier_outputs_ignore_a_later_token(how):
    x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kwargs = {"causal": True} if how == "causal=True" else {"mask": attention_mask(T, T)}
    outs = [scaled_dot_product_attention(*_project(inp), **kwargs)[0] for inp in (x, _change_one_position(x))]
    _assert_no_leak(*outs)
    # With the right mask, the earlier outputs are not just close but bit-for-bit identical.
    assert torch.equal(outs[0][:, :CHANGED], outs[1][:, :CHANGED])


def test_transposed_mask_leaks_and_the_check_catches_it():
    x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    wrong = attention_mask(T, T).T  # key j visible to query i when j >= i: the future
    before, after = (scaled_dot_product_attention(*_project(inp), mask=wrong)[0]
                     for inp in (x, _change_one_position(x)))
    with pytest.raises(AssertionError):
        _assert_no_leak(before, after)
    assert ((after - before).abs().amax(-1)[:, :CHANGED] > 1e-6).all()  # every earlier position moved


@pytest.mark.parametrize("cls", [MultiHeadAttention, CPUMultiHeadAttention])
def test_multi_head_attention_earlier_outputs_ignore_a_later_token(cls):
    torch.manual_seed(0)
    mha = cls(d_model=16, n_heads=4, n_kv_heads=2).double().eval()
    x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        _assert_no_leak(mha(x), mha(_change_one_position(x)))


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_gpt_logits_before_a_changed_token_do_not_move(positions):
    torch.manual_seed(0)
    config = GPTConfig.tiny(vocab_size=20, context_length=16, d_model=32, n_layers=2, n_heads=4,
                            d_ff=64, positions=positions)
    model = GPT(config).eval()
    ids = torch.randint(0, 20, (2, T), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, CHANGED] = (ids[:, CHANGED] + 1) % 20
    with torch.no_grad():
        _assert_no_leak(model(ids)[0], model(changed)[0])
