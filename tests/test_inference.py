"""Attention sinks, tiled attention, the int8 KV cache, speculative decoding."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lib.attention import KVCache, attention_mask
from lib.config import GPTConfig
from lib.kv_quant import QuantizedKVCache, dequantize_int8, quantize_int8
from lib.model import GPT
from lib.speculative import speculative_accept, speculative_decode
from lib.tiled_attention import tiled_attention

def test_sinks_keep_the_first_positions_visible():
    mask = attention_mask(6, 6, window=2, sinks=1)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def small_model(seed=0, **kw):
    torch.manual_seed(seed)
    config = GPTConfig.tiny(vocab_size=11, context_length=48, d_model=32, n_layers=2, n_heads=4, d_ff=64, **kw)
    return GPT(config).eval()


@pytest.mark.parametrize("T, T_k, bq, bk, H_kv", [(37, 37, 8, 16, 4), (5, 40, 4, 7, 2), (64, 64, 64, 64, 1)])
def test_tiled_attention_equals_sdpa(T, T_k, bq, bk, H_kv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, H_kv, T_k, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, H_kv, T_k, 16, generator=g, dtype=torch.float64)
    mask = attention_mask(T, T_k)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4 // H_kv, 1), v.repeat_interleave(4 // H_kv, 1),
                                         attn_mask=mask)
    torch.testing.assert_close(tiled_attention(q, k, v, bq, bk), ref)
    ref_full = F.scaled_dot_product_attention(q, k.repeat_interleave(4 // H_kv, 1), v.repeat_interleave(4 // H_kv, 1))
    torch.testing.assert_close(tiled_attention(q, k, v, bq, bk, causal=False), ref_full)


def test_tiled_attention_bad_inputs():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="block_q"):
        tiled_attention(q, q, q, block_q=0)
    with pytest.raises(ValueError, match="q must be"):
        tiled_attention(q, q[..., :4], q)
    with pytest.raises(ValueError, match="causal"):
        tiled_attention(q, q[..., :2, :], q[..., :2, :])


def test_quantize_round_trip_error_bound():
    x = torch.randn(3, 4, 10, 16) * 5
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 4, 10, 1)
    assert ((dequantize_int8(q, scale) - x).abs() <= scale / 2 + 1e-6).all()
    q0, s0 = quantize_int8(torch.zeros(2, 3))
    assert torch.equal(dequantize_int8(q0, s0), torch.zeros(2, 3))


def test_quantized_cache_is_a_drop_in_and_smaller():
    model = small_model(positions="rope", n_kv_heads=2)
    ids = torch.randint(0, 11, (1, 20))
    full = model(ids)[0]
    caches = [QuantizedKVCache() for _ in model.blocks]
    first = model(ids[:, :12], kv_caches=caches)[0]
    rest = model(ids[:, 12:], kv_caches=caches)[0]
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=0.05, rtol=0)
    assert caches[0].length == 20
    D, H_kv = model.config.head_dim, model.blocks[0].attn.n_kv_heads
    assert caches[0].nbytes() == 2 * 20 * H_kv * (D + 4)
    q, scale = caches[0].parts["k"]
    assert q.dtype == torch.int8 and q.shape == (1, H_kv, 20, D) and scale.shape == (1, H_kv, 20, 1)
    caches[0].reset()
    assert caches[0].length == 0 and caches[0].nbytes() == 0


def test_speculative_greedy_equals_target_greedy():
    target, draft = small_model(0), small_model(1)
    ids = torch.tensor([[1, 2, 3]])
    ref = target.generate(ids, 30, temperature=0.0)
    for k in (1, 3, 5):
        out, stats = speculative_decode(target, draft, ids, 30, k=k)
        assert torch.equal(out, ref)
        assert stats["rounds"] <= 30 and stats["accepted"] <= stats["proposed"]
        # every round ends on a rejection or on all k kept (then one free token)
        checked = stats["accepted"] + stats["rejected"]
        free = stats["rounds"] - stats["rejected"]      # rounds with every proposal kept
        assert checked <= 30 <= checked + free
    out, stats = speculative_decode(target, target, ids, 30, k=4)
    assert torch.equal(out, ref) and stats["accepted"] == stats["proposed"] and stats["rounds"] == 6
    assert stats["rejected"] == 0


def test_speculative_sampling_runs_and_bad_inputs():
    target, draft = small_model(0), small_model(1)
    ids = torch.tensor([[1, 2, 3]])
    out, stats = speculative_decode(target, draft, ids, 10, k=3, temperature=1.0,
                                    generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 13) and torch.equal(out[:, :3], ids)
    with pytest.raises(ValueError, match="context_length"):
        speculative_decode(target, draft, ids, 46)
    with pytest.raises(ValueError, match="k must"):
        speculative_decode(target, draft, ids, 5, k=0)
    with pytest.raises(ValueError, match="ids must"):
        speculative_decode(target, draft, ids[0], 5)
    with pytest.raises(ValueError, match="temperature"):
        speculative_decode(target, draft, ids, 5, temperature=-1.0)


def test_speculative_accept_gives_the_target_distribution():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4, dtype=torch.float64)
    n = 20000
    draws = torch.multinomial(q, n, replacement=True, generator=g)
    for t in draws.tolist():
        counts[speculative_accept(p, q, t, g)[1]] += 1
    assert (counts / n - p).abs().max() < 0.015
    assert (q - p).abs().max() > 0.3          # the draft alone is far from it


class Bigram(torch.nn.Module):
    """A model whose next-token logits depend on the last token only: fast, with known
    distributions."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits                                        # (V, V)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.logits[ids], None                               # (B, T, V)


def test_speculative_sampling_emits_the_targets_distribution():
    """Two tokens after a prompt, 3,000 times: their joint frequencies are the target's
    p(x1) p(x2 | x1) at temperature 0.8, not the draft's."""
    g = torch.Generator().manual_seed(0)
    V, temperature, n = 4, 0.8, 3000
    target, draft = Bigram(2 * torch.randn(V, V, generator=g)), Bigram(torch.randn(V, V, generator=g))
    ids = torch.tensor([[2]])
    counts = torch.zeros(V, V)
    for _ in range(n):
        out, _ = speculative_decode(target, draft, ids, 2, k=2, temperature=temperature, generator=g)
        counts[out[0, 1], out[0, 2]] += 1

    def joint(model: Bigram) -> torch.Tensor:
        probs = torch.softmax(model.logits / temperature, dim=-1)  # (V, V): row = last token
        return probs[2][:, None] * probs                           # p(x1) p(x2 | x1)

    assert (counts / n - joint(target)).abs().max() < 0.03
    assert (joint(draft) - joint(target)).abs().max() > 0.1


def test_figure_names_may_carry_a_section_letter():
    from lib import plotting
    for good in ("12b-window", "12a-ladder", "04-attention", "A1-lora"):
        assert plotting._NAME.match(good)
    for bad in ("12B-window", "12ab-x", "1b-x", "12b_x"):
        assert not plotting._NAME.match(bad)
