"""Generation that stops, and batches: ``GPT.generate`` with a stop id and left-padded prompts of
different lengths gives, token for token, what transformers' ``generate`` gives, greedy and with
seeded sampling, on tiny random Hugging Face models loaded with ``lib.pretrained.from_hf``: Llama
(RoPE, grouped-query attention) and GPT-2 (learned positions). transformers is the reference for
the whole rule: positions from the attention mask's cumulative sum, padding hidden from every
query (through the KV cache too), a stopped row padded, the loop ending when every row stopped.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from lib.attention import attention_mask  # noqa: E402
from lib.model import GPT, completions, left_pad  # noqa: E402
from lib.positional import RotaryEmbedding  # noqa: E402
from lib.pretrained import from_hf  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, PAD = 97, 1
# 7, 2, 5 and 3 tokens, ending alike (as chat prompts end by opening the assistant's turn), so
# that greedy decoding reaches a common token in every row, at different steps.
PROMPTS = [[43, 59, 88, 11, 93, 6, 85], [6, 85], [63, 68, 49, 6, 85], [29, 6, 85]]


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: make them random so that the test sees them
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) + 1.0)
    return model


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        layer_norm_epsilon=1e-5)
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    """(transformers model, the same weights in lib)."""
    hf = {"llama": llama, "gpt2": gpt2}[request.param]()
    return hf, from_hf(hf.state_dict(), hf.config.to_dict())


def theirs(hf, ids, mask, n, stop=None, pad=PAD, seed=None, **sampling):
    """transformers' generate: greedy, or sampling after torch.manual_seed(seed)."""
    if seed is not None:
        torch.manual_seed(seed)
    return hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=seed is not None,
                       eos_token_id=stop, pad_token_id=pad, **sampling)


def ours(model, ids, mask, n, stop=None, pad=PAD, seed=None, use_cache=True, **sampling):
    """lib's generate, the same way."""
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, n, attention_mask=mask, stop_id=stop, pad_id=pad, use_cache=use_cache,
                          **({"temperature": 0.0, **sampling} if seed is None else sampling))


def test_left_pad_is_what_a_left_padding_tokenizer_gives():
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    assert ids.tolist()[1] == [PAD] * 5 + [6, 85] and mask.tolist()[1] == [0] * 5 + [1, 1]
    assert ids.shape == mask.shape == (4, 7) and ids.dtype == mask.dtype == torch.long
    assert mask.sum(1).tolist() == [7, 2, 5, 3]


def test_padded_batch_logits_equal_transformers_at_every_token(pair):
    """One forward pass on the padded batch: the positions and the padding mask are right."""
    hf, model = pair
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # transformers' rule, given explicitly
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=positions).logits
    logits, _ = model(ids, attention_mask=mask)
    torch.testing.assert_close(logits[mask == 1], expected[mask == 1], atol=2e-5, rtol=1e-5)


def test_greedy_batch_with_a_stop_id_equals_transformers(pair):
    hf, model = pair
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    free = theirs(hf, ids, mask, 12)  # no stop id: every row runs 12 tokens
    assert torch.equal(ours(model, ids, mask, 12), free)
    new = free[:, ids.size(1):].tolist()
    stop = new[1][2]  # a token greedy decoding produces: row 1 stops by its third token
    first = [row.index(stop) if stop in row else None for row in new]
    assert len(set(first)) > 1  # rows stop at different steps, or not at all
    expected = theirs(hf, ids, mask, 12, stop=stop)
    assert torch.equal(ours(model, ids, mask, 12, stop=stop), expected)
    assert torch.equal(ours(model, ids, mask, 12, stop=stop, use_cache=False), expected)
    cut = completions(expected, ids.size(1), stop)
    assert [len(c) - 1 if f is not None else None for c, f in zip(cut, first)] == first
    assert [c for c, f in zip(cut, first) if f is None] == [r for r, f in zip(new, first) if f is None]


def test_generation_ends_when_every_row_has_stopped(pair):
    hf, model = pair
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    new = theirs(hf, ids, mask, 20)[:, ids.size(1):].tolist()
    # the token that every row has produced soonest: every row stops, not all at once
    latest = {t: max(row.index(t) if t in row else 99 for row in new) for t in range(VOCAB)}
    stop = min(latest, key=latest.get)
    assert latest[stop] < 19 and len({row.index(stop) for row in new}) > 2
    expected = theirs(hf, ids, mask, 20, stop=stop)  # padded with PAD after the stop
    out = ours(model, ids, mask, 20, stop=stop)
    assert torch.equal(out, expected) and out.size(1) == ids.size(1) + latest[stop] + 1
    assert all(c[-1] == stop and stop not in c[:-1] for c in completions(out, ids.size(1), stop))
    assert (out[:, ids.size(1):] == PAD).any()  # a row that stopped early was padded
    # Without a pad id a stopped row repeats the stop id, as transformers does with pad = eos.
    assert torch.equal(ours(model, ids, mask, 20, stop=stop, pad=None),
                       theirs(hf, ids, mask, 20, stop=stop, pad=stop))


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sampling_equals_transformers(pair, seed):
    """Both draw with torch.multinomial on the softmax of logits / temperature (top-k 20), one
    draw per row per step, finished rows included: the same seed gives the same tokens."""
    hf, model = pair
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    free = theirs(hf, ids, mask, 16, seed=seed, temperature=0.8, top_k=20)
    assert torch.equal(ours(model, ids, mask, 16, seed=seed, temperature=0.8, top_k=20), free)
    stop = int(free[1, ids.size(1) + 1])  # row 1's second token
    expected = theirs(hf, ids, mask, 16, stop=stop, seed=seed, temperature=0.8, top_k=20)
    for use_cache in (True, False):
        out = ours(model, ids, mask, 16, stop=stop, seed=seed, use_cache=use_cache,
                   temperature=0.8, top_k=20)
        assert torch.equal(out, expected)
    assert len(completions(expected, ids.size(1), stop)[1]) <= 2


def test_rope_rotates_each_row_by_transformers_positions():
    """RoPE on left-padded rows rotates by the positions transformers derives from the mask (the
    attention scores would hide a wrong shift: RoPE's q.k depends on relative position only)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf = llama()
    model = from_hf(hf.state_dict(), hf.config.to_dict())
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    q, k = torch.randn(2, 4, 4, 7, 16).unbind(0)  # (B, H, T, D)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cos, sin = LlamaRotaryEmbedding(hf.config)(q, positions)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    n_pad = (mask == 0).sum(1)
    rope = model.blocks[0].attn.rope
    torch.testing.assert_close(rope(q, 0, n_pad), q_hf)
    torch.testing.assert_close(rope(k, 0, n_pad), k_hf)
    # one cached step later: the next token of every row, at index 7
    cos, sin = LlamaRotaryEmbedding(hf.config)(q, positions[:, -1:] + 1)
    q_hf, _ = apply_rotary_pos_emb(q[:, :, :1], k[:, :, :1], cos, sin)
    torch.testing.assert_close(rope(q[:, :, :1], 7, n_pad), q_hf)


def test_rope_on_padded_rows_past_its_table_equals_transformers():
    """Asked past its ``context_length``, RotaryEmbedding computes the later positions; padded rows
    too: a 4-position table rotates the 7-token padded batch, and the cached step at index 7,
    by transformers' positions, as the unpadded path rotates a row that has no padding."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf = llama()
    rope = RotaryEmbedding(16, 10000.0, context_length=4)
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    n_pad = (mask == 0).sum(1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    q, k = torch.randn(2, 4, 4, 8, 16).unbind(0)  # (B, H, T, D): 7 prompt tokens, 1 step
    for offset, cut in ((0, slice(0, 7)), (7, slice(7, 8))):
        steps = positions[:, -1:] + 1 if offset else positions
        cos, sin = LlamaRotaryEmbedding(hf.config)(q, steps)
        expected, _ = apply_rotary_pos_emb(q[:, :, cut], k[:, :, cut], cos, sin)
        torch.testing.assert_close(rope(q[:, :, cut], offset, n_pad), expected)
    torch.testing.assert_close(rope(q[:1], 0, n_pad[:1]), rope(q[:1], 0))  # row 0: no padding

def test_cpu_kernels_model_takes_padded_batches_through_the_parent_path():
    hf = llama()
    model = from_hf(hf.state_dict(), hf.config.to_dict())
    fast = GPT(dataclasses.replace(model.config, cpu_kernels=True)).eval()
    fast.load_state_dict(model.state_dict())
    assert type(fast.blocks[0].attn).__name__ == "CPUMultiHeadAttention"
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    assert torch.equal(ours(fast, ids, mask, 12, stop=64), theirs(hf, ids, mask, 12, stop=64))


def test_rows_of_a_batch_equal_the_prompts_alone_past_the_context():
    """transformers does not crop at the context length, so past it the reference is the
    definition of batching: each row gets the tokens its prompt gets alone (every row here
    outgrows the 12-token context; the padded window of a row holds its last real tokens)."""
    hf = llama()
    model = from_hf(hf.state_dict(), {**hf.config.to_dict(), "max_position_embeddings": 12})
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    out = model.generate(ids, 16, temperature=0.0, attention_mask=mask)
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), 16, temperature=0.0)
        assert alone[0, len(prompt):].tolist() == out[row, ids.size(1):].tolist()


@pytest.mark.parametrize("make", [llama, gpt2])
def test_padded_batch_past_the_context_cached_equals_recomputed(make):
    """Past context_length the cache is dropped and each step recomputes on the last tokens
    (padding counted), the mask cropped with them: both paths give the same tokens."""
    hf = make()
    config, weights = hf.config.to_dict(), dict(hf.state_dict())
    if make is gpt2:  # learned positions: keep the first 12
        config["n_positions"] = 12
        weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:12]
    else:
        config["max_position_embeddings"] = 12
    model = from_hf(weights, config)
    assert model.config.context_length == 12
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    for kwargs in (dict(temperature=0.0), dict(temperature=1.0, top_k=20)):
        cached = model.generate(ids, 10, attention_mask=mask, stop_id=3, **kwargs,
                                generator=torch.Generator().manual_seed(0))
        recomputed = model.generate(ids, 10, attention_mask=mask, stop_id=3, use_cache=False,
                                    **kwargs, generator=torch.Generator().manual_seed(0))
        assert torch.equal(cached, recomputed)


def test_padded_mask_with_a_window_and_a_sink():
    """Row 1 opens with two padding tokens: its positions start at index 2, the sink is its first
    token, the window counts its own positions, and a padding query sees only itself."""
    mask = attention_mask(5, 5, window=2, sinks=1, n_pad=torch.tensor([0, 2]))
    assert mask.shape == (2, 1, 5, 5)
    unpadded = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0],
                             [1, 0, 0, 1, 1]], dtype=torch.bool)
    padded = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                           [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], unpadded) and torch.equal(mask[1, 0], padded)
    assert torch.equal(attention_mask(5, 5, window=2, sinks=1), unpadded)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(attention_mask=torch.tensor([[1, 1, 0]])), ValueError, "left padding"),
    (dict(attention_mask=torch.tensor([[0, 0, 0]])), ValueError, "at least one 1"),
    (dict(attention_mask=torch.tensor([[0, 2, 1]])), ValueError, "1 on tokens"),
    (dict(attention_mask=torch.ones(1, 4, dtype=torch.long)), ValueError, r"shape \(1, 3\)"),
    (dict(attention_mask=[[1, 1, 1]]), TypeError, "attention_mask must be a Tensor"),
    (dict(stop_id=VOCAB), ValueError, "stop_id"),
    (dict(stop_id=3, pad_id=-1), ValueError, "pad_id"),
])
def test_bad_stop_and_mask_arguments_are_clear_errors(kwargs, error, match):
    model = from_hf(gpt2().state_dict(), gpt2().config.to_dict())
    with pytest.raises(error, match=match):
        model.generate(torch.tensor([[4, 5, 6]]), 2, **kwargs)


def test_bad_left_pad_and_completions_arguments():
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        left_pad([])
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        left_pad(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"prompts\[1\] must hold at least one token id"):
        left_pad([[1, 2], []])
    with pytest.raises(TypeError, match=r"prompts\[0\] must be an integer tensor"):
        left_pad([[1.5, 2.0]])
    with pytest.raises(ValueError, match="prompt_length"):
        completions(torch.zeros(2, 3, dtype=torch.long), 4)
    assert completions(torch.tensor([[9, 1, 2, 5, 5], [9, 3, 4, 4, 7]]), 1, stop_id=5) == [
        [1, 2, 5], [3, 4, 4, 7]]


def test_repetition_penalty_counts_a_row_s_tokens_not_its_padding(pair):
    """Under a repetition penalty a padded batch still equals transformers' generate, greedy, and
    each row what its prompt gets alone: transformers too leaves the padding out (generate hands
    its RepetitionPenaltyLogitsProcessor each row's padding length as prompt_ignore_length). The
    pad id is the first token the shortest prompt draws alone, so a penalty that counted padding
    would change that row."""
    hf, model = pair
    alone = [theirs(hf, torch.tensor([p]), None, 8, repetition_penalty=3.0) for p in PROMPTS]
    pad = int(alone[1][0, len(PROMPTS[1])])
    ids, mask = left_pad(PROMPTS, pad_id=pad)
    expected = theirs(hf, ids, mask, 8, pad=pad, repetition_penalty=3.0)
    assert [row[ids.size(1):] for row in expected.tolist()] == [
        a[0, len(p):].tolist() for a, p in zip(alone, PROMPTS)]
    for use_cache in (True, False):
        out = ours(model, ids, mask, 8, pad=pad, use_cache=use_cache, repetition_penalty=3.0)
        assert torch.equal(out, expected)
