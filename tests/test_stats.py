"""lib.stats, the book's verdict rule, against scipy.stats (paired t-test, sign test)."""
import math

import pytest
import torch

from lib.stats import WORDS, compare, t_test_p, verdict

stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("df", range(1, 12))
def test_t_test_p_equals_scipy(df):
    for t in (0.0, 0.2, 1.0, 2.0, 2.7, 3.5, 6.0, 25.0, -1.3, -4.0):
        assert t_test_p(t, df) == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-9, abs=1e-13)


@pytest.mark.parametrize("n", range(3, 9))
def test_numbers_equal_scipy_paired_t_and_sign_test(n):
    g = torch.Generator().manual_seed(n)
    for _ in range(20):
        old = torch.randn(n, generator=g, dtype=torch.float64) + 2.0
        new = old + 0.6 * torch.randn(n, generator=g, dtype=torch.float64) - 0.4
        v = compare(new, old)
        d = (new - old).tolist()
        rel = stats.ttest_rel(new.numpy(), old.numpy())
        one = stats.ttest_1samp(d, 0.0)
        assert v.t == pytest.approx(rel.statistic, rel=1e-9) == pytest.approx(one.statistic)
        assert v.p == pytest.approx(rel.pvalue, rel=1e-8, abs=1e-14)
        assert v.mean == pytest.approx(sum(d) / n) and v.sd == pytest.approx(torch.tensor(d).std().item())
        assert v.sign_p == pytest.approx(stats.binomtest(sum(x > 0 for x in d), n).pvalue)
        agree = all(x < 0 for x in d) or all(x > 0 for x in d)
        expected = int(math.copysign(1, v.mean)) if agree and rel.pvalue < 0.05 else 0
        assert (v.sign, v.word) == (expected, WORDS[{-1: 0, 1: 1, 0: 2}[expected]])
        assert v.diffs == pytest.approx(d) and v.n == n


def test_the_verdict_flips_at_scipys_critical_t():
    """Diffs -3 + s*z (all negative): just inside scipy's 5% critical t clear, just outside not."""
    z = torch.tensor([-1.0, -0.5, 0.5, 1.0], dtype=torch.float64)
    t_crit = stats.t.ppf(0.975, df=3)                            # 3.18
    s = 3.0 / (t_crit * z.std().item() / 2)                      # t = -t_crit exactly
    assert verdict((-3 + 0.99 * s * z).tolist()).word == "clearly lower"
    assert verdict((-3 + 1.01 * s * z).tolist()).word == "no clear difference"
    assert verdict((3 - 0.99 * s * z).tolist()).word == "clearly higher"


def test_the_books_cases():
    # 12a's "+ RoPE" (issue 26): every seed lower, |mean|/sd 1.85 -> t = 3.7, p = 0.034
    rope = verdict([-0.137, -0.353, -0.431, -0.156])
    assert rope.word == "clearly lower" and rope.p == pytest.approx(0.0342, abs=1e-4)
    assert rope.sign_p == pytest.approx(0.125)          # a sign test alone: never below 0.125
    # the same signs with a wider spread are no longer clear
    assert verdict([-0.02, -0.353, -0.431, -0.05]).word == "no clear difference"
    # p < 0.05, but one seed of eight disagrees in sign: not clear under the book's rule
    split = verdict([-1.0, -1.1, -0.9, -1.2, -1.0, -0.95, -1.05, 0.01])
    assert split.p < 0.01 and split.sign == 0
    # five seeds the same way, yet too spread for p < 0.05
    assert verdict([-0.01, -0.02, -0.9, -0.03, -0.05]).word == "no clear difference"


def test_no_spread_and_no_difference():
    assert verdict([0.1, 0.1, 0.1]).word == "clearly higher"
    assert verdict([0.0, 0.0, 0.0]).word == "no clear difference"
    assert verdict([0.0, 0.0, 0.0]).p == 1.0


def test_words_and_printout():
    v = compare([1.0, 1.1, 1.2, 1.3], [2.0, 2.05, 2.1, 2.3], words=("less", "more", "about as much"))
    assert v.word == "less" and v.sign == -1
    assert str(v) == "less (mean -0.962, sd 0.048, t = -40.21, p = 3.4e-05, 4 seeds)"


@pytest.mark.parametrize("call, match", [
    (lambda: verdict([0.1, 0.2]), "at least 3"),
    (lambda: verdict([0.1, float("nan"), 0.2]), "finite"),
    (lambda: compare([1.0, 2.0, 3.0], [1.0, 2.0]), "one value per seed"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
