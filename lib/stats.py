"""The book's one verdict rule for comparing two methods over seeds.

Each seed runs both methods (same data, same start), giving one paired difference per seed,
`new - old`. The difference is *clear* when every seed agrees in sign and a two-sided paired
t-test on the differences gives p < 0.05; otherwise there is no clear difference. The t-test
weighs the mean against the seeds' spread; the sign agreement keeps one extreme seed from
carrying a verdict. (A sign test alone cannot reach p < 0.05 with fewer than 6 seeds.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

ALPHA = 0.05
WORDS = ("clearly lower", "clearly higher", "no clear difference")


@dataclass(frozen=True)
class Verdict:
    """A verdict word and the numbers behind it (differences are `new - old`, one per seed)."""
    word: str                  # WORDS[0] if clearly below 0, WORDS[1] if above, else WORDS[2]
    sign: int                  # -1 clearly lower, +1 clearly higher, 0 no clear difference
    diffs: tuple[float, ...]   # per-seed differences
    n: int                     # seeds
    mean: float
    sd: float                  # sample standard deviation (n - 1)
    t: float                   # mean / (sd / sqrt(n))
    p: float                   # two-sided paired t-test, n - 1 degrees of freedom
    sign_p: float              # two-sided sign test, for reference

    def __str__(self) -> str:
        return (f"{self.word} (mean {self.mean:+.3f}, sd {self.sd:.3f}, t = {self.t:.2f}, "
                f"p = {self.p:.2g}, {self.n} seeds)")


def t_test_p(t: float, df: int) -> float:
    """Two-sided p of Student's t with integer df (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, term, total = math.cos(theta) ** 2, 1.0, 0.0
    for k in range(1, df // 2 + 1):         # odd df: 1 + 2/3 c2 + ...; even: 1 + 1/2 c2 + ...
        total += term
        term *= c2 * ((2 * k) / (2 * k + 1) if df % 2 else (2 * k - 1) / (2 * k))
    if df % 2:
        inside = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    else:
        inside = math.sin(theta) * total          # P(|T| < |t|)
    return max(0.0, 1 - inside)


def verdict(diffs: Iterable[float], words: tuple[str, str, str] = WORDS) -> Verdict:
    """Judge per-seed differences `new - old` (at least 3 seeds) by the book's rule."""
    d = tuple(float(x) for x in diffs)
    if len(d) < 3 or not all(math.isfinite(x) for x in d):
        raise ValueError(f"diffs must be at least 3 finite numbers (one per seed), got {d}")
    n, mean = len(d), sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    if sd > 0:
        t = mean / (sd / math.sqrt(n))
        p = t_test_p(t, n - 1)
    else:                                     # every seed gave the same difference
        t, p = (math.copysign(math.inf, mean), 0.0) if mean else (0.0, 1.0)
    # sign test: chance of a split at least this uneven if each sign were a fair coin flip
    k, m = min(sum(x > 0 for x in d), sum(x < 0 for x in d)), sum(x != 0 for x in d)
    sign_p = min(1.0, sum(math.comb(m, i) for i in range(k + 1)) / 2 ** (m - 1)) if m else 1.0
    agree = all(x < 0 for x in d) or all(x > 0 for x in d)
    sign = (1 if mean > 0 else -1) if agree and p < ALPHA else 0
    return Verdict({-1: words[0], 1: words[1], 0: words[2]}[sign], sign, d, n, mean, sd, t, p,
                   sign_p)


def compare(new: Iterable[float], old: Iterable[float],
            words: tuple[str, str, str] = WORDS) -> Verdict:
    """Judge `new` against `old`, given one value per seed for each (same seeds, same order)."""
    new, old = [float(x) for x in new], [float(x) for x in old]
    if len(new) != len(old):
        raise ValueError(f"new and old need one value per seed each, got {len(new)} and {len(old)}")
    return verdict([a - b for a, b in zip(new, old)], words)
