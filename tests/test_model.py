"""lib.block and lib.model: parameter counts of published models, the whole forward pass against a
reference written with torch's functions (no lib code), causality, KV-cache generation."""
import math

import pytest
import torch
import torch.nn.functional as F

from lib.attention import KVCache
from lib.block import TransformerBlock
from lib.feedforward import FeedForward, SwiGLU
from lib.model import GPT, GPTConfig, attention_maps
from lib.norms import LayerNorm, RMSNorm


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def small(**overrides) -> GPTConfig:
    """A model small enough for exhaustive checks: 2 layers, 4 heads of 8 dims, 16 positions."""
    base = dict(vocab_size=29, context_length=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    return GPTConfig(**{**base, **overrides})


def model(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).double().eval()


def ids(B, T, V=29, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


VARIANTS = [
    dict(),
    dict(positions="sinusoidal", norm="rmsnorm", ffn="swiglu"),
    dict(positions="rope", n_kv_heads=2, norm="rmsnorm", ffn="swiglu"),
    dict(positions="none", ffn="gelu_tanh", bias=True),
    dict(positions="rope", window=3, n_kv_heads=1),
    dict(positions="learned", window=5, tie_embeddings=False),
    dict(positions="rope", window=4, sinks=2, qk_norm=True, norm_eps=1e-3),
]


def rotate(x, base):
    """Half-split RoPE of x (B, H, T, D) at positions 0..T-1, in float64."""
    T, D = x.shape[-2:]
    angles = torch.arange(T, dtype=torch.float64)[:, None] * base ** (
        -torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    return x * cos + torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1) * sin


def reference_logits(m: GPT, x: torch.Tensor) -> torch.Tensor:
    """``m``'s logits from its parameters with torch's functions only (F.layer_norm/rms_norm,
    F.scaled_dot_product_attention with an explicit tril/triu mask, F.gelu/silu), float64."""
    c, (B, T) = m.config, x.shape
    H, H_kv, D = c.n_heads, c.n_kv_heads or c.n_heads, c.head_dim
    P = dict(m.named_parameters(remove_duplicate=False))

    def norm(name, h, width=c.d_model):
        if c.norm == "rmsnorm" or width != c.d_model:  # QK-norm is an RMSNorm
            return F.rms_norm(h, (width,), P[name + ".weight"], c.norm_eps or 1e-6
                              if width == c.d_model else 1e-6)
        return F.layer_norm(h, (width,), P[name + ".weight"], P.get(name + ".bias"), c.norm_eps or 1e-5)

    def linear(name, h):
        return F.linear(h, P[name + ".weight"], P.get(name + ".bias"))

    h = F.embedding(x, P["tok_emb.weight"])
    if c.positions == "learned":
        h = h + P["pos_emb.embedding.weight"][:T]
    elif c.positions == "sinusoidal":  # PE[t, 2i] = sin(t / 10000^(2i/d)), PE[t, 2i+1] = cos(...)
        angles = torch.arange(T, dtype=torch.float64)[:, None] / 10000 ** (
            torch.arange(0, c.d_model, 2, dtype=torch.float64) / c.d_model)
        h = h + torch.stack((angles.sin(), angles.cos()), -1).reshape(T, c.d_model)
    ones = torch.ones(T, T, dtype=torch.bool)
    mask = ones.tril()
    if c.window is not None:
        sinks = torch.zeros(T, T, dtype=torch.bool)
        sinks[:, :c.sinks] = True
        mask = mask & (ones.triu(1 - c.window) | sinks)
    for i in range(c.n_layers):
        b = f"blocks.{i}."
        a = norm(b + "norm1", h)
        q = linear(b + "attn.q_proj", a).view(B, T, H, D).transpose(1, 2)
        k = linear(b + "attn.k_proj", a).view(B, T, H_kv, D).transpose(1, 2)
        v = linear(b + "attn.v_proj", a).view(B, T, H_kv, D).transpose(1, 2)
        if c.qk_norm:
            q, k = norm(b + "attn.q_norm", q, D), norm(b + "attn.k_norm", k, D)
        if c.positions == "rope":
            q, k = rotate(q, c.rope_base), rotate(k, c.rope_base)
        k, v = k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, -1)
        h = h + linear(b + "attn.out_proj", y)
        f = norm(b + "norm2", h)
        if c.ffn == "swiglu":
            f = F.silu(linear(b + "ffn.w_gate", f)) * linear(b + "ffn.w_up", f)
            h = h + linear(b + "ffn.w_down", f)
        else:
            f = linear(b + "ffn.fc_in", f)
            f = F.relu(f) if c.ffn == "relu" else F.gelu(f, approximate="tanh" if c.ffn == "gelu_tanh"
                                                         else "none")
            h = h + linear(b + "ffn.fc_out", f)
    return F.linear(norm("norm_f", h), P["lm_head.weight"])


# ---------------------------------------------------------------- parameter counts (meta device)

def count_on_meta(config: GPTConfig) -> GPT:
    with torch.device("meta"):
        m = GPT(config)
    assert all(p.is_meta for p in m.parameters())  # nothing was allocated
    return m


def test_gpt2_small_has_the_published_parameter_count():
    m = count_on_meta(GPTConfig.gpt2_small())
    assert m.num_parameters() == 124_439_808
    counts = m.parameter_counts()
    assert sum(counts.values()) == 124_439_808
    assert counts["embeddings"] == 50257 * 768 and counts["positions"] == 1024 * 768 and counts["head"] == 0


def test_llama_style_preset_matches_llama_3_2_1b():
    config = GPTConfig.llama_style()
    assert (config.vocab_size, config.d_model, config.n_layers, config.n_heads, config.n_kv_heads,
            config.d_ff, config.norm, config.ffn, config.positions, config.rope_base, config.tie_embeddings) == \
        (128256, 2048, 16, 32, 8, 8192, "rmsnorm", "swiglu", "rope", 500000.0, True)
    m = count_on_meta(config)
    assert m.num_parameters() == 1_235_814_400
    assert m.num_parameters() + m.lm_head.weight.numel() == 1_498_482_688
    untied = count_on_meta(GPTConfig.llama_style(tie_embeddings=False))
    assert untied.num_parameters() == 1_498_482_688
    assert untied.parameter_counts()["head"] == 128256 * 2048


@pytest.mark.parametrize("kwargs", VARIANTS)
def test_parameter_counts_by_component_sum_to_the_total(kwargs):
    config = small(**kwargs)
    m = count_on_meta(config)
    counts = m.parameter_counts()
    assert sum(counts.values()) == m.num_parameters()
    C, L = config.d_model, config.n_layers
    kv = (config.n_kv_heads or config.n_heads) * config.head_dim
    attn = L * (2 * C * C + 2 * C * kv + (2 * C + 2 * kv if config.bias else 0)
                + (2 * config.head_dim if config.qk_norm else 0))  # QK-norm gains
    assert counts["attention"] == attn
    assert counts["positions"] == (config.context_length * C if config.positions == "learned" else 0)
    assert counts["head"] == (0 if config.tie_embeddings else config.vocab_size * C)


# ---------------------------------------------------------------- structure and initialisation

def test_presets_choose_the_right_components():
    gpt2 = count_on_meta(GPTConfig.gpt2_small())
    block = gpt2.blocks[0]
    assert isinstance(block, TransformerBlock) and isinstance(block.norm1, LayerNorm)
    assert block.norm1.bias is not None and block.attn.q_proj.bias is not None
    assert isinstance(block.ffn, FeedForward) and block.ffn.act.approximate == "tanh"
    assert gpt2.lm_head.weight is gpt2.tok_emb.weight
    llama = count_on_meta(GPTConfig.llama_style())
    assert isinstance(llama.blocks[0].ffn, SwiGLU) and isinstance(llama.norm_f, RMSNorm)
    assert llama.pos_emb is None and llama.blocks[0].attn.rope.base == 500000.0
    tiny = GPTConfig.tiny()
    assert tiny.vocab_size == 65 and GPTConfig.tiny(vocab_size=80, n_layers=2).n_layers == 2


def test_gpt2_initialisation_scales_residual_projections():
    torch.manual_seed(0)
    m = GPT(GPTConfig.tiny(n_layers=8, d_model=256, d_ff=1024))
    L = 8
    for block in m.blocks:
        assert block.attn.out_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * L), rel=0.05)
        assert block.ffn.fc_out.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * L), rel=0.05)
        assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert torch.equal(block.norm1.weight, torch.ones(256))
    assert m.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    with torch.no_grad():
        m.norm_f.weight.fill_(3.0)
        m.blocks[0].ffn.fc_out.weight.fill_(1.0)
    m.reset_parameters()  # starts over: norms back to 1, projections re-drawn
    assert torch.equal(m.norm_f.weight, torch.ones(256))
    assert m.blocks[0].ffn.fc_out.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * L), rel=0.05)


def test_initial_loss_is_close_to_uniform_guessing():
    m = GPT(GPTConfig.tiny())
    x = ids(4, 64, V=65)
    _, loss = m(x, ids(4, 64, V=65, seed=1))
    assert abs(loss.item() - math.log(65)) < 0.1


# ---------------------------------------------------------------- forward

@pytest.mark.parametrize("kwargs", VARIANTS)
def test_logits_and_loss_equal_a_reference_written_with_torch_functions(kwargs):
    """Every variant (positions none/learned/sinusoidal/rope, windows, sinks, QK-norm, GQA,
    biases, untied head) against reference_logits; the loss against the written-out mean of
    -log p(target) on the reference logits."""
    m = model(small(**kwargs))
    with torch.no_grad():  # random norm gains and biases, so that a dropped one shows
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    x, y = ids(3, 10), ids(3, 10, seed=1)
    logits, loss = m(x, y)
    ref = reference_logits(m, x)
    torch.testing.assert_close(logits, ref)
    logp = ref.log_softmax(-1).gather(-1, y[..., None])
    torch.testing.assert_close(loss, -logp.mean())
    assert m(x)[1] is None


@pytest.mark.parametrize("kwargs", VARIANTS)
def test_logits_at_t_do_not_depend_on_later_tokens(kwargs):
    m = model(small(**kwargs))
    a = ids(2, 12)
    b = a.clone()
    b[:, 7:] = ids(2, 5, seed=9)
    la, lb = m(a)[0], m(b)[0]
    torch.testing.assert_close(la[:, :7], lb[:, :7], rtol=0, atol=1e-12)
    assert not torch.allclose(la[:, 7:], lb[:, 7:])


def test_config_builds_what_runs():
    """Window, sinks and the CPU attention kernel come from the config, at construction."""
    from lib.cpu_kernels import CPUMultiHeadAttention

    m = model(small(positions="rope", window=4, sinks=2))
    assert all((b.attn.window, b.attn.sinks) == (4, 2) for b in m.blocks)
    m = model(small(positions="rope", cpu_kernels=True))
    assert all(type(b.attn) is CPUMultiHeadAttention for b in m.blocks)
    assert all(type(b.attn) is not CPUMultiHeadAttention for b in model(small()).blocks)


def test_attention_maps_are_causal_distributions():
    m = model(small(n_layers=3))
    maps = attention_maps(m, ids(2, 9))
    assert len(maps) == 3
    for w in maps:
        assert w.shape == (2, 4, 9, 9)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 9, dtype=torch.float64))
        assert (w.triu(diagonal=1) == 0).all()


def test_dropout_is_on_in_training_and_off_in_eval_and_generate():
    m = model(small(dropout=0.3))
    x = ids(2, 8)
    m.train()
    assert not torch.equal(m(x)[0], m(x)[0])
    out = m.generate(x, 3, temperature=0)
    assert m.training  # generate restores the mode it found
    m.eval()
    assert torch.equal(m.generate(x, 3, temperature=0), out)


def test_bfloat16_model_tracks_the_float32_one():
    torch.manual_seed(0)
    m = GPT(small(positions="sinusoidal", norm="rmsnorm"))
    x, y = ids(2, 8), ids(2, 8, seed=1)
    logits32, loss32 = m(x, y)
    logits, loss = m.to(torch.bfloat16)(x, y)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(logits.float(), logits32, rtol=0, atol=0.05)
    torch.testing.assert_close(loss, loss32, rtol=0, atol=0.02)


def test_a_few_steps_of_training_lower_the_loss():
    torch.manual_seed(0)
    m = GPT(small(positions="rope", norm="rmsnorm", ffn="swiglu"))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    x = ids(4, 16)
    y = torch.roll(x, -1, dims=1)
    first = None
    for _ in range(30):
        _, loss = m(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


# ---------------------------------------------------------------- KV cache and generation

@pytest.mark.parametrize("kwargs", VARIANTS)
def test_cached_forward_gives_the_logits_of_full_recomputation(kwargs):
    m = model(small(**kwargs))
    x = ids(2, 16)
    full, _ = m(x)
    caches = [KVCache() for _ in m.blocks]
    pieces = [m(x[:, a:b], kv_caches=caches)[0] for a, b in [(0, 6), (6, 7), (7, 8), (8, 12), (12, 16)]]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)
    assert all(c.length == 16 for c in caches)


@pytest.mark.parametrize("kwargs", VARIANTS)
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, top_k=5),
                                      dict(temperature=0.8, top_p=0.9)])
def test_generation_with_cache_equals_generation_without(kwargs, sampling):
    m = model(small(**kwargs))
    prompt = ids(2, 4)
    # 20 new tokens run past context_length=16: the cached path must then fall back to cropping
    with_cache = m.generate(prompt, 20, use_cache=True, generator=torch.Generator().manual_seed(3), **sampling)
    without = m.generate(prompt, 20, use_cache=False, generator=torch.Generator().manual_seed(3), **sampling)
    assert with_cache.shape == (2, 24)
    assert torch.equal(with_cache[:, :4], prompt)
    assert torch.equal(with_cache, without)


def test_generate_with_top_k_1_is_greedy_and_greedy_is_argmax():
    m = model(small(positions="rope"))
    prompt = ids(3, 5)
    greedy = m.generate(prompt, 8, temperature=0)
    top1 = m.generate(prompt, 8, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy, top1)
    manual = prompt
    for _ in range(8):
        manual = torch.cat([manual, m(manual)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, manual)


def test_generation_is_reproducible_with_a_generator():
    m = model(small())
    a = m.generate(ids(1, 3), 10, generator=torch.Generator().manual_seed(5))
    b = m.generate(ids(1, 3), 10, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    assert torch.equal(m.generate(ids(1, 3), 0), ids(1, 3))


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=30), "d_model .* divisible by n_heads"),
    (dict(n_kv_heads=3), "n_heads .* divisible by n_kv_heads"),
    (dict(d_model=12, n_heads=4, positions="rope"), "positions='rope' needs an even head dimension"),
    (dict(d_model=15, n_heads=3, positions="sinusoidal"), "positions='sinusoidal' needs an even d_model"),
    (dict(sinks=2), "sinks=2 needs a window"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling needs positions"),
    (dict(ffn="moe", n_experts=1, moe_top_k=1), "n_experts"),
    (dict(cpu_kernels=1), "cpu_kernels"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(ffn="swish"), "ffn must be one of"),
    (dict(positions="alibi"), "positions must be one of"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(dropout=1.0), "dropout"),
    (dict(window=0), "window"),
    (dict(rope_base=1.0), "rope_base"),
])
def test_bad_configs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small(**kwargs)


def test_config_round_trips_through_a_dict():
    config = small(positions="rope", n_kv_heads=2, window=4)
    assert GPTConfig.from_dict(config.to_dict()) == config
    assert GPTConfig.from_dict(small(window=3, sinks=1).to_dict()).sinks == 1
    assert GPTConfig.from_dict(small(cpu_kernels=True).to_dict()).cpu_kernels
    with pytest.raises(TypeError, match="n_embd"):
        GPTConfig.from_dict({**config.to_dict(), "n_embd": 3})
    with pytest.raises(TypeError, match="config must be a GPTConfig"):
        GPT(config.to_dict())


def test_bad_ids_are_clear_errors():
    m = model(small())
    with pytest.raises(ValueError, match="longer than context_length=16"):
        m(ids(1, 17))
    caches = [KVCache() for _ in m.blocks]
    m(ids(1, 10), kv_caches=caches)
    with pytest.raises(ValueError, match="longer than context_length=16"):
        m(ids(1, 7), kv_caches=caches)
    # Token ranges are checked where ids enter (generate), not in every forward.
    with pytest.raises(ValueError, match=r"token id 29, out of range \[0, vocab_size=29\)"):
        m.generate(torch.tensor([[1, 29]]), 2)
    with pytest.raises(IndexError):  # forward leaves it to the embedding's own bounds check (CPU)
        m(torch.tensor([[1, 29]]))
    with pytest.raises(TypeError, match="integer tensor"):
        m.generate(torch.zeros(1, 3), 2)
    with pytest.raises(ValueError, match="2-D tensor"):
        m.generate(torch.tensor([1, 2, 3]), 2)
    with pytest.raises(ValueError, match="at least one token id"):
        attention_maps(m, torch.zeros(1, 0, dtype=torch.long))


def test_eval_mode_restores_the_mode_even_after_an_error():
    from lib.checks import eval_mode

    m = model(small(dropout=0.3)).train()
    with eval_mode(m):
        assert not m.training and not m.blocks[0].training
    assert m.training and m.blocks[0].attn.resid_dropout.training
    with pytest.raises(RuntimeError, match="inside"):
        with eval_mode(m):
            raise RuntimeError("inside")
    assert m.training
    m.eval()
    with eval_mode(m):
        pass
    assert not m.training


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.2), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty="high"), "repetition_penalty"),
])
def test_bad_generation_arguments_are_clear_errors(kwargs, match):
    m = model(small())
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        m.generate(ids(1, 3), **kwargs)


def test_generate_applies_min_p_and_repetition_penalty():
    m = model(small())
    prompt = ids(2, 5)
    plain = m.generate(prompt, 6, temperature=0)
    same = m.generate(prompt, 6, temperature=0, repetition_penalty=1.0, min_p=0.0)
    assert torch.equal(plain, same)  # 1.0 and 0.0 switch them off
    # min_p = 1 keeps only the most likely token: sampling becomes greedy.
    g = torch.Generator().manual_seed(0)
    assert torch.equal(m.generate(prompt, 6, min_p=1.0, generator=g), plain)
    # A huge penalty on a greedy decoder forbids any token already in the sequence.
    out = m.generate(prompt, 6, temperature=0, repetition_penalty=1e6)
    for row in out:
        new = row[5:].tolist()
        assert not set(new) & set(row[:5].tolist()) and len(set(new)) == len(new)
