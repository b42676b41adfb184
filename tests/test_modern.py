"""Chapter 12a's lib pieces: QK-norm, the mixture-of-experts feed-forward, Muon (lib.optim) and its use
in lib.training.configure_optimizer / TrainConfig(optimizer='muon')."""
from __future__ import annotations

import inspect

import pytest
import torch

from lib.attention import MultiHeadAttention
from lib.config import GPTConfig, TrainConfig
from lib.feedforward import MoE
from lib.model import GPT
from lib.optim import MuonAdamW, newton_schulz
from lib.training import configure_optimizer, train


# ---- QK-norm -------------------------------------------------------------------------------------

def test_qk_norm_default_off_keeps_parameters():
    plain = GPT(GPTConfig.tiny())
    assert not any("q_norm" in n or "k_norm" in n for n, _ in plain.named_parameters())
    normed = GPT(GPTConfig.tiny(qk_norm=True))
    extra = normed.num_parameters() - plain.num_parameters()
    assert extra == 4 * 2 * GPTConfig.tiny().head_dim  # one gain for q, one for k, per layer


def test_qk_norm_matches_written_out_attention():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, qk_norm=True)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 16)
    out = attn(x)  # MultiHeadAttention returns the output alone
    q = attn.q_proj(x).view(2, 5, 4, 4).transpose(1, 2)
    k = attn.k_proj(x).view(2, 5, 4, 4).transpose(1, 2)
    v = attn.v_proj(x).view(2, 5, 4, 4).transpose(1, 2)
    q = q / q.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * attn.q_norm.weight
    k = k / k.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * attn.k_norm.weight
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = attn.out_proj(y.transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(out, expected)


def test_qk_norm_with_rope_and_gqa_matches_transformers_qwen3():
    """lib's QK-norm is Qwen3's (and Gemma 3's): an RMSNorm over each head's query and key, before
    RoPE (OLMo 2 instead normalises the whole projection before the split into heads)."""
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from lib.positional import RotaryEmbedding

    torch.manual_seed(8)
    config = qwen3.Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, rms_norm_eps=1e-6, attention_bias=False)
    config._attn_implementation = "sdpa"
    theirs = qwen3.Qwen3Attention(config, layer_idx=0).eval()
    ours = MultiHeadAttention(32, 4, n_kv_heads=2, rope=RotaryEmbedding(8, base=config.rope_parameters[
        "rope_theta"]), qk_norm=True).eval()
    with torch.no_grad():
        for mine, hf in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                         ("out_proj", "o_proj"), ("q_norm", "q_norm"), ("k_norm", "k_norm")):
            getattr(theirs, hf).weight.copy_(torch.randn_like(getattr(theirs, hf).weight))
            getattr(ours, mine).weight.copy_(getattr(theirs, hf).weight)
        x = torch.randn(2, 7, 32)
        position_ids = torch.arange(7)[None].expand(2, 7)
        cos_sin = qwen3.Qwen3RotaryEmbedding(config)(x, position_ids)
        expected, _ = theirs(x, position_embeddings=cos_sin, attention_mask=None)
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)


def test_qk_norm_bad_input():
    with pytest.raises(ValueError, match="qk_norm"):
        GPTConfig.tiny(qk_norm="yes")


# ---- mixture of experts ----------------------------------------------------------------------------

def _dense_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by a (N, E) gate matrix that is zero off the top k."""
    flat = x.reshape(-1, x.size(-1))
    probs = torch.softmax(moe.router(flat), dim=-1)
    top_p, top_i = probs.topk(moe.top_k, dim=-1)
    if moe.top_k > 1:  # Mixtral renormalises its top k; the Switch Transformer gates by p itself
        top_p = top_p / top_p.sum(-1, keepdim=True)
    gates = torch.zeros_like(probs).scatter(1, top_i, top_p)
    outs = torch.stack([expert(flat) for expert in moe.experts], dim=1)  # (N, E, C)
    return (gates[:, :, None] * outs).sum(1).reshape(x.shape)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_equals_dense_loop(top_k):
    torch.manual_seed(0)
    moe = MoE(8, 16, n_experts=4, top_k=top_k)
    x = torch.randn(2, 7, 8)
    torch.testing.assert_close(moe(x), _dense_moe(moe, x))
    assert int(moe.expert_counts.sum()) == 2 * 7 * top_k


def test_moe_all_experts_with_one_expert_width_is_gated_mean():
    torch.manual_seed(1)
    moe = MoE(8, 16, n_experts=3, top_k=3)
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform router: gates 1/3 each
    x = torch.randn(4, 8)[None]
    expected = sum(expert(x) for expert in moe.experts) / 3
    out = moe(x)
    torch.testing.assert_close(out, expected)
    aux = moe.balancing_loss(*moe.route(x[0])[:2])
    assert aux.item() == pytest.approx(1.0)  # uniform probabilities: the loss's minimum


def test_moe_aux_loss_grows_with_imbalance():
    torch.manual_seed(2)
    moe = MoE(8, 16, n_experts=4, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 5.0  # expert 0 wins for inputs with a positive feature sum
    x = torch.rand(1, 32, 8)
    moe(x)
    aux = moe.balancing_loss(*moe.route(x[0])[:2])
    assert moe.expert_counts.tolist() == [32, 0, 0, 0]
    assert aux.item() > 3.5
    aux.backward()
    assert moe.router.weight.grad.abs().sum() > 0  # gradient reaches the router through P_e


def test_gpt_moe_training_gradient_is_cross_entropys_plus_transformers_balancing_loss():
    """In training mode GPT's loss is F.cross_entropy alone, and its gradient is that of
    F.cross_entropy plus aux_weight times the sum over layers of transformers' Mixtral
    balancing loss of that layer's router logits, divided by k (the reference is taken in
    eval mode, where nothing is attached; without dropout the two modes compute the same)."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    torch.manual_seed(0)
    config = GPTConfig.tiny(ffn="moe", n_experts=4, moe_top_k=2, d_ff=64, n_layers=2, moe_aux_weight=0.5)
    model = GPT(config)
    router_logits = []
    for block in model.blocks:
        block.ffn.router.register_forward_hook(lambda m, i, out: router_logits.append(out))
    ids, targets = torch.randint(0, 65, (2, 12)), torch.randint(0, 65, (2, 12))
    logits, ce = model.eval()(ids, targets)
    torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(logits.reshape(-1, 65), targets.reshape(-1)))
    balance = sum(mixtral.load_balancing_loss_func((r,), num_experts=4, top_k=2) / 2
                  for r in router_logits)
    assert len(router_logits) == 2 and balance > 1.0   # above its minimum: a term that counts
    params = list(model.parameters())
    expected = torch.autograd.grad(ce + 0.5 * balance, params, allow_unused=True, retain_graph=True)
    _, loss = model.train()(ids, targets)
    torch.testing.assert_close(loss, ce)                 # the value: cross-entropy alone
    loss.backward()
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, torch.zeros_like(p) if g is None else g)
    ce_only = torch.autograd.grad(ce, [b.ffn.router.weight for b in model.blocks])
    assert all(not torch.allclose(b.ffn.router.weight.grad, g) for b, g in zip(model.blocks, ce_only))
    assert GPTConfig.tiny(ffn="moe", n_experts=4, moe_top_k=1).aux_weight == 0.01  # Switch's alpha
    assert GPTConfig.tiny().aux_weight == 0.0


def test_moe_bad_input():
    with pytest.raises(ValueError, match="n_experts"):
        GPTConfig.tiny(ffn="moe", moe_top_k=1)
    with pytest.raises(ValueError, match="n_experts"):
        GPTConfig.tiny(ffn="moe", n_experts=1, moe_top_k=1)
    with pytest.raises(ValueError, match="moe_top_k"):
        GPTConfig.tiny(ffn="moe", n_experts=4, moe_top_k=5)
    with pytest.raises(ValueError, match="moe_aux_weight"):
        GPTConfig.tiny(ffn="moe", n_experts=4, moe_top_k=1, moe_aux_weight=-1.0)


def test_moe_expert_computes_swiglu_scaled_by_its_probability():
    torch.manual_seed(3)
    moe = MoE(8, 16, n_experts=3, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[1, 0] = 50.0  # expert 1 wins every token with a positive first feature
    x = torch.rand(1, 6, 8) + 0.1
    p1 = torch.softmax(moe.router(x), dim=-1)[..., 1:2]
    w = moe.experts[1]
    gate, up = x @ w.w_gate.weight.T, x @ w.w_up.weight.T
    expected = p1 * ((gate * torch.sigmoid(gate) * up) @ w.w_down.weight.T)
    torch.testing.assert_close(moe(x), expected)
    assert moe.expert_counts.tolist() == [0, 6, 0]


def _router_grad(top_k: int, renormalise_top1: bool = False) -> float:
    """|dL/dW_r| from a task loss alone (no balancing term) for a fresh MoE."""
    torch.manual_seed(4)
    moe = MoE(16, 32, n_experts=4, top_k=top_k, aux_weight=0.0)
    x, target = torch.randn(64, 16), torch.randn(64, 16)
    if renormalise_top1:  # the old gate p / p = 1: what the router would get then
        route = moe.route
        moe.route = lambda t: (lambda p, e, g: (p, e, g / g.sum(-1, keepdim=True)))(*route(t))
    torch.nn.functional.mse_loss(moe(x), target).backward()
    return moe.router.weight.grad.norm().item()


@pytest.mark.parametrize("top_k", [1, 2])
def test_task_loss_alone_trains_the_router(top_k):
    assert _router_grad(top_k) > 1e-3


def test_renormalised_top1_gate_would_starve_the_router():
    assert _router_grad(1, renormalise_top1=True) < 1e-6 < 1e-3 < _router_grad(1)


def _copy_experts(block, moe: MoE) -> None:
    """Copy lib's router and experts into a transformers sparse-MoE block (gate and up
    projections stacked as transformers stores them)."""
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.weight)
        for e, expert in enumerate(moe.experts):
            block.experts.gate_up_proj[e].copy_(torch.cat([expert.w_gate.weight, expert.w_up.weight]))
            block.experts.down_proj[e].copy_(expert.w_down.weight)


def _mixtral_block(moe: MoE):
    """transformers' MixtralSparseMoeBlock with the weights of ``moe`` copied in."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    config = mixtral.MixtralConfig(hidden_size=moe.d_model, intermediate_size=moe.experts[0].w_up.out_features,
                                   num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                                   hidden_act="silu", router_jitter_noise=0.0)
    block = mixtral.MixtralSparseMoeBlock(config).eval()
    _copy_experts(block, moe)
    return block, mixtral.load_balancing_loss_func


@pytest.mark.parametrize("top_k", [2, 3])
def test_renormalised_top_k_matches_transformers_mixtral(top_k):
    torch.manual_seed(5)
    moe = MoE(16, 24, n_experts=4, top_k=top_k).eval()
    block, balance = _mixtral_block(moe)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        out = moe(x)
        torch.testing.assert_close(out, block(x))
        logits = moe.router(x.reshape(-1, 16))
        aux = moe.balancing_loss(*moe.route(x.reshape(-1, 16))[:2])
    # transformers counts f_e over tokens (summing to k); lib over the N k assignments (to 1)
    hf = balance((logits,), num_experts=4, top_k=top_k)
    torch.testing.assert_close(aux, hf / top_k)


def test_top1_balancing_loss_matches_transformers():
    torch.manual_seed(6)
    moe = MoE(16, 24, n_experts=4, top_k=1).eval()
    _, balance = _mixtral_block(moe)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        aux = moe.balancing_loss(*moe.route(x.reshape(-1, 16))[:2])
        logits = moe.router(x.reshape(-1, 16))
    torch.testing.assert_close(aux, balance((logits,), num_experts=4, top_k=1))


def _olmoe_block(moe: MoE):
    """transformers' OlmoeSparseMoeBlock with norm_topk_prob=False (gates = the router's
    probabilities, the Switch Transformer's top-1 rule) and the weights of ``moe`` copied in."""
    olmoe = pytest.importorskip("transformers.models.olmoe.modeling_olmoe")
    config = olmoe.OlmoeConfig(hidden_size=moe.d_model, intermediate_size=moe.experts[0].w_up.out_features,
                               num_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                               norm_topk_prob=False, hidden_act="silu")
    block = olmoe.OlmoeSparseMoeBlock(config).eval()
    _copy_experts(block, moe)
    return block, olmoe.load_balancing_loss_func


def test_top1_matches_transformers_olmoe_without_renormalisation():
    torch.manual_seed(7)
    moe = MoE(16, 24, n_experts=4, top_k=1).eval()
    block, balance = _olmoe_block(moe)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        out = moe(x)
        torch.testing.assert_close(out, block(x))
        logits = moe.router(x.reshape(-1, 16))
        aux = moe.balancing_loss(*moe.route(x.reshape(-1, 16))[:2])
    torch.testing.assert_close(aux, balance((logits,), num_experts=4, top_k=1))
    # the gate is p itself, not p / p = 1: the output is not the chosen expert's plain output
    chosen = logits.argmax(-1)
    plain = torch.stack([moe.experts[int(e)](t) for e, t in zip(chosen, x.reshape(-1, 16))])
    assert (out.reshape(-1, 16) - plain).abs().max() > 1e-2


# ---- Muon ----------------------------------------------------------------------------------------

def test_newton_schulz_pushes_singular_values_towards_one():
    torch.manual_seed(0)
    G = torch.randn(16, 32) @ torch.diag(torch.logspace(-2, 1, 32))
    s = torch.linalg.svdvals(newton_schulz(G).float())
    assert s.min() > 0.3 and s.max() < 1.3
    assert newton_schulz(torch.randn(32, 16)).shape == (32, 16)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_muon_groups_match_torch_optimizers():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 12))
    b = torch.nn.Parameter(torch.randn(12))
    w_ref, b_ref = (torch.nn.Parameter(t.detach().clone()) for t in (w, b))
    ours = MuonAdamW([{"params": [w], "use_muon": True}, {"params": [b]}], lr=0.02, weight_decay=0.1)
    # lib's Newton-Schulz uses addmm, as torch 2.13's Muon always does; a torch where it is an option
    # (use_addmm, off by default: its plain matmul path rounds differently in bfloat16) is asked
    # for it explicitly
    addmm = {"use_addmm": True} if "use_addmm" in inspect.signature(torch.optim.Muon).parameters else {}
    muon = torch.optim.Muon([w_ref], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw",
                            **addmm)
    adamw = torch.optim.AdamW([b_ref], lr=0.02, weight_decay=0.1, betas=(0.9, 0.95))
    for _ in range(4):
        gw, gb = torch.randn(8, 12), torch.randn(12)
        w.grad, w_ref.grad, b.grad, b_ref.grad = gw, gw.clone(), gb, gb.clone()
        ours.step()
        muon.step()
        adamw.step()
    torch.testing.assert_close(w, w_ref)
    torch.testing.assert_close(b, b_ref)


def test_configure_optimizer_muon_groups():
    model = GPT(GPTConfig.tiny(n_layers=1, tie_embeddings=False))
    opt = configure_optimizer(model, 1e-3, 0.1, optimizer="muon")
    assert isinstance(opt, MuonAdamW)
    muon_ids = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    assert id(model.lm_head.weight) not in muon_ids and id(model.tok_emb.weight) not in muon_ids
    assert id(model.blocks[0].attn.q_proj.weight) in muon_ids
    assert id(model.blocks[0].ffn.fc_in.weight) in muon_ids
    n = sum(len(g["params"]) for g in opt.param_groups)
    assert n == len(list(model.parameters()))
    assert isinstance(configure_optimizer(model, 1e-3, 0.1), torch.optim.AdamW)


def test_train_with_muon_runs_and_resumes(tmp_path):
    torch.manual_seed(0)
    data = torch.randint(0, 65, (2000,))
    config = TrainConfig(max_steps=6, batch_size=4, context_length=16, warmup_steps=2, eval_interval=3,
                         eval_batches=2, optimizer="muon")
    model = GPT(GPTConfig.tiny(n_layers=1, d_model=32, n_heads=2, d_ff=64))
    history = train(model, data, data, config, progress=False)
    assert len(history.batch_loss) == 6 and all(torch.isfinite(torch.tensor(history.val_loss)))
    path = tmp_path / "ckpt.safetensors"
    a = GPT(GPTConfig.tiny(n_layers=1, d_model=32, n_heads=2, d_ff=64))
    b = GPT(GPTConfig.tiny(n_layers=1, d_model=32, n_heads=2, d_ff=64))
    b.load_state_dict(a.state_dict())
    full = train(a, data, data, config, progress=False)
    train(b, data, data, config, checkpoint_path=path, stop_at=3, progress=False)
    resumed = train(b, data, data, config, checkpoint_path=path, resume=True, progress=False)
    assert resumed.batch_loss == pytest.approx(full.batch_loss)


def test_muon_bad_input():
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="optimizer"):
        configure_optimizer(GPT(GPTConfig.tiny(n_layers=1)), 1e-3, 0.1, optimizer="lion")
    with pytest.raises(ValueError, match="params"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.randn(3))], "use_muon": True}])
    with pytest.raises(ValueError, match="momentum"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.randn(3, 3))]}], momentum=1.5)
