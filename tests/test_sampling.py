"""lib.sampling: greedy, temperature, top-k and top-p filters, reproducible draws."""
import pytest
import torch

from lib.sampling import (apply_repetition_penalty, apply_temperature, check_sampling_args, greedy,
                          min_p_filter, sample_next,
                          top_k_filter, top_p_filter)


def random_logits(*shape, seed=0, dtype=torch.float64):
    return 3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_greedy_is_argmax():
    logits = random_logits(4, 10)
    assert torch.equal(greedy(logits), logits.argmax(-1))
    assert greedy(logits[0]).shape == ()


def test_temperature_scales_logits_and_sharpens_or_flattens():
    logits = random_logits(3, 10)
    torch.testing.assert_close(apply_temperature(logits, 1.0), logits)
    torch.testing.assert_close(apply_temperature(logits, 0.5), 2 * logits)
    p = torch.softmax(logits, -1).amax(-1)
    assert (torch.softmax(apply_temperature(logits, 0.5), -1).amax(-1) > p).all()
    assert (torch.softmax(apply_temperature(logits, 2.0), -1).amax(-1) < p).all()


def test_top_k_keeps_the_k_largest():
    logits = random_logits(5, 20)
    for k in (1, 3, 20, 50):
        kept = torch.isfinite(top_k_filter(logits, k))
        assert (kept.sum(-1) == min(k, 20)).all()
        top = logits.topk(min(k, 20), dim=-1).indices
        assert kept.gather(-1, top).all()
    filtered = top_k_filter(logits, 3)
    kept = torch.isfinite(filtered)
    assert torch.equal(filtered[kept], logits[kept])  # the survivors are untouched


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    for seed in range(20):
        logits = random_logits(3, 12, seed=seed)
        for p in (0.05, 0.3, 0.5, 0.8, 0.9, 0.99):
            kept = torch.isfinite(top_p_filter(logits, p))
            probs = torch.softmax(logits, -1)
            for row in range(3):
                n = int(kept[row].sum())
                order = probs[row].argsort(descending=True)
                # the kept tokens are the n most likely ones ...
                assert set(order[:n].tolist()) == set(kept[row].nonzero().flatten().tolist())
                mass = probs[row, order].cumsum(0)
                assert mass[n - 1] >= p  # ... their mass reaches p ...
                assert n == 1 or mass[n - 2] < p  # ... and one token fewer would not


def test_top_p_extremes():
    logits = random_logits(4, 9)
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    only_best = torch.isfinite(top_p_filter(logits, 1e-9))
    assert torch.equal(only_best.nonzero()[:, 1], logits.argmax(-1))


def test_sampling_is_reproducible_with_a_generator():
    logits = random_logits(8, 50)
    a = sample_next(logits, generator=torch.Generator().manual_seed(7))
    b = sample_next(logits, generator=torch.Generator().manual_seed(7))
    assert a.shape == (8,) and a.dtype == torch.long
    assert torch.equal(a, b)


def test_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    draws = sample_next(logits.expand(20000, 4), generator=g)
    freq = torch.bincount(draws, minlength=4).double() / 20000
    torch.testing.assert_close(freq, torch.softmax(logits.double(), -1), rtol=0, atol=0.015)


def test_filters_restrict_what_can_be_drawn():
    logits = random_logits(1, 30).expand(3000, 30)
    g = torch.Generator().manual_seed(1)
    draws = sample_next(logits, temperature=1.5, top_k=4, generator=g)
    assert set(draws.tolist()) == set(logits[0].topk(4).indices.tolist())
    draws = sample_next(logits, top_p=0.5, generator=g)
    assert set(draws.tolist()) <= set(torch.isfinite(top_p_filter(logits[0], 0.5)).nonzero().flatten().tolist())


def test_temperature_zero_and_top_k_one_are_greedy():
    logits = random_logits(6, 40)
    assert torch.equal(sample_next(logits, temperature=0), greedy(logits))
    assert torch.equal(sample_next(logits, top_k=1, generator=torch.Generator().manual_seed(0)), greedy(logits))


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    """check_sampling_args, which generate calls once (sample_next runs per token, unchecked)."""
    with pytest.raises(ValueError, match=match):
        check_sampling_args(**kwargs)


def test_min_p_keeps_tokens_at_least_p_times_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.1, 0.1, 0.1, 0.7]], dtype=torch.float64))
    out = min_p_filter(logits, 0.3)  # thresholds 0.15 and 0.21
    assert torch.isfinite(out).tolist() == [[True, True, True, False], [False, False, False, True]]
    kept = torch.isfinite(out)
    torch.testing.assert_close(out[kept], logits[kept])  # kept logits are untouched
    assert torch.equal(min_p_filter(logits, 0.0), logits)
    assert torch.isfinite(min_p_filter(logits, 1.0)).sum(-1).tolist() == [1, 1]
    logits = random_logits(3, 50)
    for p in (0.01, 0.1, 0.5):
        probs = torch.softmax(logits, -1)
        expected = probs >= p * probs.max(-1, keepdim=True).values
        assert torch.equal(torch.isfinite(min_p_filter(logits, p)), expected)


def test_repetition_penalty_lowers_every_seen_token_whatever_its_sign():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    previous = torch.tensor([[0, 1, 1]])  # token 1 twice: penalised once, like any seen token
    out = apply_repetition_penalty(logits, previous, 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]
    assert torch.equal(apply_repetition_penalty(logits, previous, 1.0), logits)
    batch = random_logits(2, 7)
    prev = torch.tensor([[0, 3], [6, 6]])
    out = apply_repetition_penalty(batch, prev, 1.5)
    seen = torch.zeros(2, 7, dtype=torch.bool)
    seen[0, [0, 3]] = True
    seen[1, 6] = True
    torch.testing.assert_close(out[~seen], batch[~seen])
    assert (out[seen] < batch[seen]).all()  # every seen token's logit goes down


def test_sample_next_applies_penalty_before_greedy_and_filters():
    logits = torch.tensor([[3.0, 2.9, -1.0]])
    previous = torch.tensor([[0]])
    assert sample_next(logits, temperature=0).item() == 0
    assert sample_next(logits, temperature=0, repetition_penalty=1.5, previous_ids=previous).item() == 1
    g = torch.Generator().manual_seed(0)
    draws = sample_next(logits.expand(200, 3), min_p=0.5, generator=g)
    assert set(draws.tolist()) == {0, 1}  # token 2 is far below half the top probability


@pytest.mark.parametrize("penalty", [0.7, 1.0, 1.3, 2.5])
def test_repetition_penalty_equals_transformers(penalty):
    """The rule is Hugging Face's RepetitionPenaltyLogitsProcessor (divide positive logits,
    multiply negative ones), not CTRL's, which divides every seen logit."""
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(4, 50, generator=g)  # both signs
    previous = torch.randint(0, 50, (4, 12), generator=g)
    ours = apply_repetition_penalty(logits, previous, penalty)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(previous, logits.clone())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    ctrl = logits.scatter(-1, previous, logits.gather(-1, previous) / penalty)  # CTRL: z / theta
    negative_seen = logits.gather(-1, previous) < 0
    if penalty > 1:  # where they differ, CTRL raises a seen token and HF lowers it
        assert (ctrl.gather(-1, previous)[negative_seen]
                > ours.gather(-1, previous)[negative_seen]).all()
