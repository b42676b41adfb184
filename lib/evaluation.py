"""Measuring a language model: bits per byte, answers scored by likelihood, pass@k,
and how sure a score is.

- :func:`bits_per_byte`: the model's code length for a text in bits, divided by the
  text's UTF-8 bytes, so that models with different tokenizers share one axis.
- :func:`continuation_logprobs`: the summed log-probability of each continuation after
  its context, split as lm-evaluation-harness splits it (:func:`split_pair`), many
  pairs per forward pass. Multiple choice picks the answer with the highest score, raw
  (``acc``) or divided by the answer's characters (``acc_norm``).
- :func:`pass_at_k`: the unbiased estimator of Chen et al. (2021) for "at least one
  of k samples is right", from n samples of which c are right.
- :func:`wilson_interval` (a confidence interval for an accuracy) and
  :func:`mcnemar_exact` (two systems on the same items, by their discordant pairs).
- :func:`calibration`: accuracy against confidence per bin, and the expected
  calibration error.
- :func:`strict_number` and :func:`last_number`: two rules for reading a number out
  of a generated reply, one that asks for the number alone and one that takes the
  last number it finds (page E scores by both; page F rewards by the first).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

import torch
import torch.nn.functional as F

from .checks import check_int, check_number, eval_mode, model_device


@dataclass(frozen=True)
class BitsPerByte:
    """The code length of a text: ``nats`` summed over ``tokens`` scored tokens,
    which spell ``bytes`` UTF-8 bytes. ``bpb`` is ``nats / ln 2 / bytes``; ``loss``
    the mean per token, ``nats / tokens``."""
    nats: float
    tokens: int
    bytes: int

    @property
    def bpb(self) -> float:
        return self.nats / math.log(2) / self.bytes

    @property
    def loss(self) -> float:
        return self.nats / self.tokens


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, tokenizer, text: str,
                  window: int | None = None) -> BitsPerByte:
    """Score ``text`` with ``model`` in consecutive windows of ``window`` predictions
    (default and at most the model's ``context_length``); each window starts with the
    previous window's last token, so every token after the first is predicted once.
    The first token has nothing to be predicted from: it is left out, tokens and
    bytes both."""
    ids = tokenizer.encode(text) if isinstance(text, str) else []
    if len(ids) < 2:
        raise ValueError(f"text must be a str of at least two tokens, got {text!r:.60}")
    ctx = model.config.context_length
    window = check_int("window", window if window is not None else ctx, maximum=ctx)
    data = torch.tensor(ids, device=model_device(model))
    nats = 0.0
    with eval_mode(model):
        for start in range(0, len(ids) - 1, window):
            chunk = data[start:start + window + 1][None]  # (1, <= window + 1)
            logits, _ = model(chunk[:, :-1])
            logp = F.log_softmax(logits.float(), dim=-1)
            nats -= logp.gather(-1, chunk[:, 1:, None]).double().sum().item()
    first = len(tokenizer.decode(ids[:1]).encode("utf-8"))
    return BitsPerByte(nats, len(ids) - 1, len(text.encode("utf-8")) - first)


def split_pair(tokenizer, context: str, continuation: str
               ) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` as lm-evaluation-harness splits them
    (``_encode_pair``): trailing whitespace of the context moves to the
    continuation, context + continuation is encoded whole, and the continuation's
    tokens are those after the context's own encoding (a merge across the boundary
    can make them differ from the continuation encoded alone)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def continuation_logprobs(model: torch.nn.Module, tokenizer,
                          context: str | Sequence[str], continuations: Sequence[str],
                          batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed log-probability (float64, ``(n,)``) of each of the ``n``
    ``continuations`` after ``context`` (one str for all, or one per continuation),
    and the number of continuation tokens (int64, ``(n,)``), split by
    :func:`split_pair`. Pairs go through the model ``batch_size`` at a time,
    longest first, right-padded (causal attention: padding after a token changes
    nothing before it). A pair longer than the context window keeps its last
    ``context_length + 1`` tokens, as the harness does."""
    contexts = ([context] * len(continuations) if isinstance(context, str)
                else list(context))
    ok = isinstance(continuations, (list, tuple)) and len(continuations) == len(
        contexts) > 0 and all(isinstance(s, str) for s in [*contexts, *continuations])
    if not ok:
        raise ValueError("continuations must be a non-empty list of str, and context "
                         "a str or a list of str of the same length")
    check_int("batch_size", batch_size)
    pairs = [split_pair(tokenizer, c, s) for c, s in zip(contexts, continuations)]
    if not all(ctx and cont for ctx, cont in pairs):
        raise ValueError("every context and continuation must encode to a token")
    limit, device = model.config.context_length + 1, model_device(model)
    seqs = [(ctx + cont)[-limit:] for ctx, cont in pairs]
    counts = torch.tensor([min(len(cont), limit - 1) for _, cont in pairs])
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out = torch.zeros(len(seqs), dtype=torch.float64)
    with eval_mode(model):
        for b in range(0, len(order), batch_size):
            rows = order[b:b + batch_size]
            batch = torch.zeros(len(rows), len(seqs[rows[0]]), dtype=torch.long)
            for r, i in enumerate(rows):
                batch[r, :len(seqs[i])] = torch.tensor(seqs[i])
            batch = batch.to(device)
            # only positions that predict a continuation token need the log-softmax
            lo = min(len(seqs[i]) - 1 - int(counts[i]) for i in rows)
            logp = F.log_softmax(model(batch[:, :-1])[0][:, lo:].float(), dim=-1)
            picked = logp.gather(-1, batch[:, lo + 1:, None])[..., 0].double().cpu()
            for r, i in enumerate(rows):  # the last counts[i] targets of the row
                end = len(seqs[i]) - 1 - lo
                out[i] = picked[r, end - counts[i]:end].sum()
    return out, counts


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of ``k`` samples drawn without replacement from
    ``n`` (``c`` of them correct) is correct, ``1 - C(n - c, k) / C(n, k)``, written
    as a product that stays in floating-point range (Chen et al. 2021)."""
    n, k = check_int("n", n), check_int("k", k, maximum=n)
    c = check_int("c", c, minimum=0, maximum=n)
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def wilson_interval(successes: int, n: int, confidence: float = 0.95
                    ) -> tuple[float, float]:
    """The Wilson score interval for a proportion ``successes / n``: the p whose
    test ``|successes/n - p| <= z sqrt(p (1 - p) / n)`` does not reject."""
    n, s = check_int("n", n), check_int("successes", successes, minimum=0, maximum=n)
    confidence = check_number("confidence", confidence, 0, 1, True, True)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p, z2 = s / n, z * z / n
    centre = (p + z2 / 2) / (1 + z2)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n)) / (1 + z2)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(a_correct: Sequence[bool], b_correct: Sequence[bool]
                  ) -> tuple[int, int, float]:
    """Two systems scored on the same items: ``(b, c, p)``, b the items only A gets
    right, c those only B gets right, p the two-sided exact binomial test of b out
    of b + c at one half (items both get right, or both wrong, say nothing about
    which is better)."""
    if len(a_correct) != len(b_correct):
        raise ValueError(f"a_correct and b_correct must score the same items, got "
                         f"{len(a_correct)} and {len(b_correct)}")
    b = sum(bool(x) and not bool(y) for x, y in zip(a_correct, b_correct))
    c = sum(bool(y) and not bool(x) for x, y in zip(a_correct, b_correct))
    tail = sum(math.comb(b + c, i) for i in range(min(b, c) + 1)) / 2 ** (b + c)
    return b, c, min(1.0, 2 * tail)


def calibration(confidence: torch.Tensor, correct: torch.Tensor, bins: int = 10
                ) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ece, mean confidence, accuracy, count)`` over ``bins`` equal-width bins of
    confidence in [0, 1] (bin i holds (i/bins, (i+1)/bins], the first also 0). The
    expected calibration error is the count-weighted mean |accuracy - confidence|."""
    conf, hit = confidence.double().flatten(), correct.double().flatten()
    index = (torch.ceil(conf * bins).long() - 1).clamp(0, bins - 1)
    count = torch.bincount(index, minlength=bins).double()
    mean_conf = torch.bincount(index, conf, minlength=bins) / count.clamp(min=1)
    accuracy = torch.bincount(index, hit, minlength=bins) / count.clamp(min=1)
    ece = ((count / count.sum()) * (accuracy - mean_conf).abs()).sum().item()
    return ece, mean_conf, accuracy, count


def majority_vote(answers: Sequence[object]) -> object:
    """The most frequent answer (None answers do not vote; ties go to the one seen
    first); None when no answer votes."""
    votes: dict[object, int] = {}
    for a in answers:
        if a is not None:
            votes[a] = votes.get(a, 0) + 1
    return max(votes, key=votes.get) if votes else None


def strict_number(reply: str) -> int | None:
    """The reply read as one whole number, or None: optional whitespace, an optional
    ASCII minus sign (not U+2212), decimal digits (``\\d``: any script's, as ``int``
    reads them), an optional full stop right after them, optional whitespace, nothing
    else (``" 12."`` gives 12; ``"12 ."``, ``"12 apples"`` and ``"5 + 7 = 12"`` give
    None)."""
    if not isinstance(reply, str):
        raise TypeError(f"reply must be a str, got {type(reply).__name__}")
    found = re.fullmatch(r"\s*(-?\d+)\.?\s*", reply)
    return int(found[1]) if found else None


def last_number(reply: str) -> int | None:
    """The last run of decimal digits (any script's) in the reply, with an ASCII minus
    sign right before it if there is one, as an int; None when the reply has no digit.
    ``"5 + 7 = 12"`` gives 12; it reads no decimals or separators: ``"12.5"`` gives 5,
    ``"10,000"`` 0 and ``"2024-11-26"`` -26."""
    if not isinstance(reply, str):
        raise TypeError(f"reply must be a str, got {type(reply).__name__}")
    found = re.findall(r"-?\d+", reply)
    return int(found[-1]) if found else None
