"""lib.posttrain's RL functions (issue 31) against references that are not lib:

- group_advantages against TRL's GRPOTrainer advantage code written out in plain Python
  (group mean, Bessel-corrected std as TRL's nanstd, + 1e-4), for each ``scale``;
- kl_estimate against the exact KL of two categorical distributions by enumeration (k1
  and k3 unbiased, k2 not) and by Monte Carlo within the standard error;
- policy_loss against PPO's clipped objective written out token by token in float64 for
  each aggregation (GRPO, DAPO, Dr. GRPO as TRL's _compute_loss does them), and its
  autograd gradient against the gradient derived by hand;
- the score-function (REINFORCE) estimator built from policy_loss: its mean over many
  samples equals the exact gradient of a small categorical policy, within its standard
  error; with the group mean subtracted (not a baseline: it includes the
  reward's own draw) its mean is (G - 1) / G times that gradient;
- rollout against one-prompt greedy generation; grpo raises a toy reward; with the frozen
  lower blocks shared with the reference it gives the plain path's log and weights bit for
  bit; it logs the zero-signal share and, at beta 0, the KL; bad arguments raise errors
  that name them.
"""
from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch
import torch.nn.functional as F

from lib.config import GPTConfig
from lib.model import GPT, completions
from lib.posttrain import (IGNORE, grpo, group_advantages, kl_estimate, pad_batch,
                           policy_loss, rollout, token_logprobs)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig.tiny(vocab_size=20, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                            context_length=64)
    return GPT(config).eval()


# group_advantages ----------------------------------------------------------------------

def trl_advantages(rewards: list[float], G: int, scale: str) -> list[float]:
    """TRL GRPOTrainer's advantages, written out: rewards minus the group mean, divided
    (scale_rewards "group" or "batch") by the sample std (n - 1) plus 1e-4."""
    out = []
    for g in range(0, len(rewards), G):
        group = rewards[g:g + G]
        mean = sum(group) / G
        std = {"group": statistics.stdev(group), "batch": statistics.stdev(rewards),
               "none": None}[scale]
        out += [(r - mean) / (std + 1e-4) if std is not None else r - mean for r in group]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trls_formula_written_out(scale):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.25, 3.0, 2.0]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), 3, scale)
    assert torch.allclose(got, torch.tensor(trl_advantages(rewards, 3, scale),
                                            dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_group_of_equal_rewards_has_zero_advantage():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0]), 3)
    assert adv[:3].abs().max() == 0 and adv[3:].abs().min() > 0.5


# kl_estimate ---------------------------------------------------------------------------

P = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64)  # the policy
Q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)  # the reference


def test_kl_estimators_against_exact_kl_by_enumeration():
    """E_{x~p}[k(x)] summed over all five outcomes: k1 and k3 give KL(p||q) exactly, k2
    does not (it is biased); k2 and k3 are >= 0 everywhere, k1 is negative somewhere."""
    exact = (P * (P.log() - Q.log())).sum()
    mean = {k: (P * kl_estimate(P.log(), Q.log(), k)).sum() for k in ("k1", "k2", "k3")}
    assert torch.allclose(mean["k1"], exact, rtol=1e-12)
    assert torch.allclose(mean["k3"], exact, rtol=1e-12)
    assert abs(mean["k2"] - exact) > 1e-3 * exact
    assert (kl_estimate(P.log(), Q.log(), "k3") >= 0).all()
    assert (kl_estimate(P.log(), Q.log(), "k2") >= 0).all()
    assert (kl_estimate(P.log(), Q.log(), "k1") < 0).any()


def test_kl_estimators_by_monte_carlo():
    """200,000 draws from p: the k1 and k3 means fall within 4 standard errors of the
    exact KL, and k3's spread is smaller than k1's."""
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(P, 200_000, replacement=True, generator=g)
    exact = float((P * (P.log() - Q.log())).sum())
    for kind in ("k1", "k3"):
        k = kl_estimate(P.log()[x], Q.log()[x], kind)
        se = float(k.std()) / math.sqrt(len(k))
        assert abs(float(k.mean()) - exact) < 4 * se, kind
    k1, k3 = (kl_estimate(P.log()[x], Q.log()[x], kind) for kind in ("k1", "k3"))
    assert k3.std() < 0.5 * k1.std()


# token_logprobs and policy_loss --------------------------------------------------------

def test_token_logprobs_against_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11)
    targets = torch.randint(0, 11, (3, 6))
    targets[0, :2] = targets[2, 4:] = IGNORE
    want = -F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE,
                            reduction="none")
    assert torch.allclose(token_logprobs(logits, targets), want, atol=1e-6)


def loss_written_out(logp, old, adv, mask, clip, clip_high, aggregate, ref=None,
                     beta=0.0, max_length=None):
    """PPO's clipped objective per token, loop by loop in float64, aggregated as TRL's
    _compute_loss does for loss_type grpo / dapo (bnpo) / dr_grpo."""
    B, T = len(logp), len(logp[0])
    rows, total, count = [], 0.0, 0
    for b in range(B):
        row, n = 0.0, 0
        for t in range(T):
            if not mask[b][t]:
                continue
            ratio = math.exp(logp[b][t] - old[b][t])
            bounded = min(max(ratio, 1 - clip), 1 + clip_high)
            loss = -min(ratio * adv[b], bounded * adv[b])
            if ref is not None:
                d = ref[b][t] - logp[b][t]
                loss += beta * (math.exp(d) - d - 1)
            row, n = row + loss, n + 1
        rows.append(row / max(n, 1))
        total, count = total + row, count + n
    if aggregate == "sequence":
        return sum(rows) / B
    if aggregate == "token":
        return total / count
    return total / (B * (max_length or T))


def random_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(4, 7, generator=g, dtype=torch.float64)  # ratios far from 1
    ref = logp + 0.3 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 0.0, -2.0], dtype=torch.float64)
    lengths = [7, 3, 5, 1]
    mask = torch.tensor([[t < n for t in range(7)] for n in lengths])
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("aggregate", ["sequence", "token", "constant"])
@pytest.mark.parametrize("clip_high", [None, 0.28])
def test_policy_loss_against_ppo_written_out(aggregate, clip_high):
    logp, old, ref, adv, mask = random_batch()
    ratio = (logp - old).exp()[mask]
    assert (ratio > 1.28).any() and (ratio < 0.8).any()  # both sides get clipped
    got = policy_loss(logp, old, adv, mask, 0.2, clip_high, aggregate)
    want = loss_written_out(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(),
                            0.2, clip_high or 0.2, aggregate)
    assert math.isclose(float(got), want, rel_tol=1e-12)
    got = policy_loss(logp, old, adv, mask, 0.2, clip_high, aggregate, max_length=10,
                      ref_logprobs=ref, beta=0.05)
    want = loss_written_out(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(),
                            0.2, clip_high or 0.2, aggregate, ref.tolist(), 0.05,
                            max_length=10)
    assert math.isclose(float(got), want, rel_tol=1e-12)


def test_policy_loss_gradient_against_the_derivation():
    """d loss / d logp_t = -A * ratio_t * w_t where the unclipped term is the smaller one
    (ratio inside the range, or outside it on the side that lowers the objective), and 0
    where the clipped term is; w_t = 1 / (B * |o_b|) for "sequence"."""
    logp, old, _, adv, mask = random_batch(1)
    logp.requires_grad_(True)
    policy_loss(logp, old, adv, mask, 0.2).backward()
    ratio, A = (logp - old).exp().detach(), adv[:, None]
    clipped = ((ratio > 1.2) & (A > 0)) | ((ratio < 0.8) & (A < 0))
    m = mask.double()
    weight = m / m.sum(1, keepdim=True) / len(m)
    want = torch.where(clipped, 0.0, -A * ratio) * weight
    assert clipped[mask].any() and not clipped[mask].all()
    assert torch.allclose(logp.grad, want, rtol=1e-12, atol=1e-15)


def test_one_update_gradient_is_reinforce():
    """old = logp detached: the ratio is 1, nothing is clipped, and the gradient is
    -A / (B |o_b|) on every response token."""
    logp, _, _, adv, mask = random_batch(2)
    logp.requires_grad_(True)
    policy_loss(logp, logp.detach(), adv, mask, 0.2).backward()
    m = mask.double()
    want = -adv[:, None] * m / m.sum(1, keepdim=True) / len(m)
    assert torch.allclose(logp.grad, want, rtol=1e-12, atol=1e-15)


# REINFORCE on an enumerable policy -----------------------------------------------------

THETA = torch.tensor([0.3, -0.2, 0.5, 0.0, -0.4], dtype=torch.float64)
REWARD = torch.tensor([1.0, 0.0, 0.2, 0.7, 0.0], dtype=torch.float64)


def exact_gradient() -> torch.Tensor:
    """grad_theta of J = sum_k softmax(theta)_k r_k, by autograd on the enumeration."""
    theta = THETA.clone().requires_grad_(True)
    (theta.softmax(0) * REWARD).sum().backward()
    return theta.grad


def estimates(G: int, n_groups: int, scale: str | None) -> torch.Tensor:
    """One gradient estimate per group of G draws: -grad of policy_loss, with the
    rewards as advantages (scale None) or group_advantages(scale)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n_groups):
        theta = THETA.clone().requires_grad_(True)
        logp = theta.log_softmax(0)
        x = torch.multinomial(logp.exp().detach(), G, replacement=True, generator=g)
        r = REWARD[x]
        adv = r if scale is None else group_advantages(r, G, scale)
        lp = logp[x][:, None]  # one token per response
        loss = policy_loss(lp, lp.detach(), adv, torch.ones_like(lp, dtype=torch.bool))
        (-loss).backward()
        out.append(theta.grad)
    return torch.stack(out)


@pytest.mark.parametrize("scale, factor", [(None, 1.0), ("none", 3 / 4)])
def test_reinforce_mean_equals_exact_gradient(scale, factor):
    """The plain estimator is unbiased; subtracting the group mean (not a baseline: it
    includes the reward's own draw) shrinks its mean by (G - 1) / G = 3/4 and lowers its total
    variance (summed over the five coordinates) even after rescaling by G / (G - 1)."""
    est = estimates(4, 6000, scale)
    se = est.std(0) / math.sqrt(len(est))
    assert ((est.mean(0) - factor * exact_gradient()).abs() < 4 * se).all()
    other = 3 / 4 if factor == 1.0 else 1.0  # the other case's factor is told apart
    assert ((est.mean(0) - other * exact_gradient()).abs() > 4 * se).any()
    if scale is not None:
        plain = estimates(4, 6000, None)
        assert (est / factor).var(0).sum() < 0.8 * plain.var(0).sum()


# rollout and grpo ----------------------------------------------------------------------

def test_rollout_matches_one_prompt_generation_and_its_layout():
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    examples, responses = rollout(model, prompts, 2, 6, stop_id=0, temperature=0.0)
    assert len(examples) == len(responses) == 6
    for k, (response, (inputs, targets)) in enumerate(zip(responses, examples)):
        prompt = prompts[k // 2]
        alone = model.generate(torch.tensor([prompt]), 6, temperature=0.0, stop_id=0)
        assert response == completions(alone, len(prompt), 0)[0]
        assert inputs.tolist() == (prompt + response)[:-1]
        assert targets.tolist() == [IGNORE] * (len(prompt) - 1) + response
    # right-padded scoring equals each row scored alone
    inputs, targets = pad_batch(examples)
    batched = token_logprobs(model(inputs)[0], targets).sum(1)
    for k, (x, y) in enumerate(examples):
        alone = token_logprobs(model(x[None])[0], y[None]).sum()
        assert torch.allclose(batched[k], alone, atol=1e-5)


def test_rollout_stops_at_stop_id():
    model = tiny_model(1)
    _, responses = rollout(model, [[1, 2]], 16, 12, stop_id=3,
                           generator=torch.Generator().manual_seed(0))
    stopped = [r for r in responses if 3 in r]
    assert stopped and all(r.index(3) == len(r) - 1 for r in stopped)
    assert all(len(r) == 12 for r in responses if 3 not in r)


def test_grpo_raises_a_toy_reward_and_is_deterministic():
    """Reward 1 when the response contains token 7: the mean reward of the last 8 of 30
    steps is well above that of the first 8; the same seed gives the same log."""
    prompts = [[1, 2, 3], [4, 5], [6, 8, 9]]

    def run(steps):
        model = tiny_model()
        return grpo(model, prompts, lambda i, r: float(7 in r), steps=steps, lr=4e-3,
                    stop_id=0, group_size=4, prompts_per_step=3, max_new_tokens=6,
                    seed=0)

    log = run(30)
    first = sum(row["reward"] for row in log[:8]) / 8
    last = sum(row["reward"] for row in log[-8:]) / 8
    assert last > first + 0.3, (first, last)
    assert log[:3] == run(3)


def test_grpo_with_a_reference_reports_kl():
    model, ref = tiny_model(), tiny_model()
    log = grpo(model, [[1, 2], [3]], lambda i, r: float(len(r)), steps=4, lr=1e-2,
               stop_id=0, group_size=3, prompts_per_step=2, max_new_tokens=5,
               updates=2, beta=0.1, ref_model=ref, aggregate="token")
    assert log[0]["kl"] == 0.0 and log[-1]["kl"] > 0  # the first batch is the reference's
    assert all(1 <= row["length"] <= 5 for row in log)


def test_grpo_constant_divisor_is_batch_times_max_new_tokens(monkeypatch):
    """aggregate="constant" is TRL's dr_grpo: each response token's loss is divided by
    B * max_new_tokens, whatever the prompts' and responses' lengths in the batch (the
    padded width T would change with the longest prompt)."""
    from lib import posttrain
    real, weights = posttrain.policy_loss, []

    def spy(logprobs, old, advantages, mask, *args, **kwargs):
        leaf = logprobs.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(real(leaf, old, advantages, mask, *args, **kwargs),
                                      leaf)
        A = advantages[:, None].expand_as(mask)
        keep = mask & (A != 0)  # response tokens whose answer has an advantage
        weights.append((-grad[keep] / A[keep]).tolist())
        return real(logprobs, old, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(posttrain, "policy_loss", spy)
    for prompt in ([1, 2], [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12]):
        grpo(tiny_model(), [prompt], lambda i, r: float(len(r)), steps=2, lr=1e-2,
             stop_id=0, group_size=4, prompts_per_step=1, max_new_tokens=5,
             aggregate="constant", scale="none")
    flat = [w for step in weights for w in step]
    assert len(weights) == 4 and len(flat) > 8
    assert all(abs(w - 1 / (4 * 5)) < 1e-6 for w in flat), sorted(set(flat))


# bad arguments -------------------------------------------------------------------------

def test_bad_arguments_raise():
    r = torch.zeros(6)
    lp = torch.zeros(2, 3)
    adv, mask = torch.zeros(2), torch.ones(2, 3, dtype=torch.bool)
    model = tiny_model()
    cases = [
        (lambda: group_advantages(r, 4), ValueError, "rewards"),
        (lambda: group_advantages([0.0, 1.0], 2), ValueError, "rewards"),
        (lambda: group_advantages(r, 1), ValueError, "group_size"),
        (lambda: group_advantages(r, 3, scale="std"), ValueError, "scale"),
        (lambda: group_advantages(r, 3, eps=-1.0), ValueError, "eps"),
        (lambda: kl_estimate(lp, lp, "k4"), ValueError, "kind"),
        (lambda: policy_loss(lp, lp, torch.zeros(3), mask), ValueError, "advantages"),
        (lambda: policy_loss(lp, lp[:, :2], adv, mask), ValueError, "old_logprobs"),
        (lambda: policy_loss(lp, lp, adv, mask[:1]), ValueError, "mask"),
        (lambda: policy_loss(lp[0], lp[0], adv, mask[0]), ValueError, "logprobs"),
        (lambda: policy_loss(lp, lp, adv, mask, clip=0), ValueError, "clip"),
        (lambda: policy_loss(lp, lp, adv, mask, clip_high=-1.0), ValueError, "clip_high"),
        (lambda: policy_loss(lp, lp, adv, mask, aggregate="mean"), ValueError, "aggregate"),
        (lambda: policy_loss(lp, lp, adv, mask, beta=-0.1), ValueError, "beta"),
        (lambda: rollout(model, [], 2, 4, 0), ValueError, "prompts"),
        (lambda: rollout(model, [[1]], 0, 4, 0), ValueError, "group_size"),
        (lambda: rollout(model, [[1]], 2, 0, 0), ValueError, "max_new_tokens"),
        (lambda: grpo(model, [[1]], "exact", 1, 1e-3, 0), TypeError, "reward_fn"),
        (lambda: grpo(model, [[1]], len, 0, 1e-3, 0), ValueError, "steps"),
        (lambda: grpo(model, [[1]], len, 1, 0.0, 0), ValueError, "lr"),
        (lambda: grpo(model, [[1]], len, 1, 1e-3, 0, prompts_per_step=2), ValueError,
         "prompts_per_step"),
        (lambda: grpo(model, [[1]], len, 1, 1e-3, 0, prompts_per_step=1, updates=0),
         ValueError, "updates"),
        (lambda: grpo(model, [[1]], len, 1, 1e-3, 0, prompts_per_step=1, beta=0.1),
         ValueError, "ref_model"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=name):
            call()


def test_grpo_scores_responses_at_the_sampling_temperature(monkeypatch):
    """At temperature T the old log-probabilities (and the reference's) are those of
    softmax(logits / T), the distribution the responses were drawn from (TRL divides the
    logits by T too); T = 0 (greedy: every group identical, no signal) is refused."""
    import torch.nn.functional as F
    from lib import posttrain
    real, seen = posttrain.policy_loss, []

    def spy(logprobs, old, advantages, mask, *args, **kwargs):
        seen.append((old, kwargs["ref_logprobs"], mask))
        return real(logprobs, old, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(posttrain, "policy_loss", spy)
    real_pad, batches = posttrain.pad_batch, []
    monkeypatch.setattr(posttrain, "pad_batch",
                        lambda *a, **k: batches.append(real_pad(*a, **k)) or batches[-1])
    model, ref = tiny_model(), tiny_model(seed=1)
    start = copy.deepcopy(model)  # the policy that samples (grpo updates model after)
    grpo(model, [[1, 2, 3]], lambda i, r: float(len(r)), steps=1, lr=1e-3, stop_id=0,
         group_size=4, prompts_per_step=1, max_new_tokens=5, temperature=0.5,
         beta=0.1, ref_model=ref)
    (old, ref_lp, mask), ((inputs, targets),) = seen[0], batches
    with torch.no_grad():
        for net, got in ((start, old), (ref, ref_lp)):
            logits = net(inputs)[0].double()
            picked = targets.clamp(min=0)[..., None]
            want = F.log_softmax(logits / 0.5, dim=-1).gather(-1, picked)[..., 0]
            torch.testing.assert_close(got[mask].double(), want[mask], rtol=0, atol=1e-5)
            at_one = F.log_softmax(logits, dim=-1).gather(-1, picked)[..., 0]
            assert (got[mask].double() - at_one[mask]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="temperature"):
        grpo(tiny_model(), [[1, 2]], lambda i, r: 0.0, steps=1, lr=1e-3, stop_id=0,
             temperature=0.0)


def test_grpo_shares_the_frozen_lower_blocks_with_the_reference(monkeypatch):
    """With the lower blocks frozen and equal to the reference's, grpo runs them once per
    batch for both models: the log and the trained weights are exactly those of the
    plain path (each model run whole); the count stops at the first block that trains
    or differs, and is 0 when the embeddings differ."""
    from lib import posttrain
    torch.manual_seed(0)
    config = GPTConfig.tiny(vocab_size=20, d_model=32, n_layers=3, n_heads=4, d_ff=64,
                            context_length=64)
    start = GPT(config).eval().requires_grad_(False)

    def run(share: bool):
        model = copy.deepcopy(start)
        model.blocks[-1].requires_grad_(True)
        if not share:
            monkeypatch.setattr(posttrain, "_shared_frozen_blocks", lambda m, r: 0)
        log = grpo(model, [[1, 2, 3], [4, 5]], lambda i, r: float(7 in r), steps=4,
                   lr=1e-2, stop_id=0, group_size=4, prompts_per_step=2,
                   max_new_tokens=5, beta=0.1, ref_model=start, updates=2)
        monkeypatch.undo()
        return log, model

    policy = copy.deepcopy(start)
    policy.blocks[-1].requires_grad_(True)
    assert posttrain._shared_frozen_blocks(policy, start) == 2
    assert posttrain._shared_frozen_blocks(policy, None) == 0
    other = copy.deepcopy(start)
    other.tok_emb.weight.data[0, 0] += 1.0
    assert posttrain._shared_frozen_blocks(policy, other) == 0
    (log_a, model_a), (log_b, model_b) = run(True), run(False)
    assert log_a == log_b and log_a[-1]["kl"] > 0
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in  # the top block did train
               zip(model_a.blocks[-1].parameters(), start.blocks[-1].parameters()))


def test_grpo_logs_the_zero_signal_share_and_kl_without_a_penalty():
    """zero_signal is the share of a step's groups whose rewards are all equal (here a
    constant reward: every group); with beta = 0 and a reference the KL is measured."""
    model, ref = tiny_model(), tiny_model()
    log = grpo(model, [[1, 2], [3]], lambda i, r: 1.0, steps=2, lr=1e-2, stop_id=0,
               group_size=3, prompts_per_step=2, max_new_tokens=5, ref_model=ref)
    assert [row["zero_signal"] for row in log] == [1.0, 1.0]
    log = grpo(tiny_model(), [[1, 2], [3]], lambda i, r: float(i == 0 and 7 in r),
               steps=3, lr=1e-2, stop_id=0, group_size=3, prompts_per_step=2,
               max_new_tokens=5, ref_model=tiny_model(1))
    assert all(row["kl"] > 0 for row in log)  # a different reference: KL from step 1
    assert all(row["zero_signal"] in (0.5, 1.0) for row in log)  # prompt 1: always 0
