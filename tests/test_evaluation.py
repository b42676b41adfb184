"""lib.evaluation against what ships: continuation log-probabilities and bits per byte
against transformers running SmolLM2's GGUF file, the split against lm-evaluation-harness's
rule written out, the statistics against scipy.stats, pass@k against enumerating every
k-subset, and bad input."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from lib.config import GPTConfig
from lib.evaluation import (bits_per_byte, calibration, continuation_logprobs, last_number,
                            majority_vote, strict_number,
                            mcnemar_exact, pass_at_k, split_pair, wilson_interval)
from lib.model import GPT
from lib.tokenizers import CharTokenizer

# Contexts with and without trailing spaces, continuations of 1 to many tokens, no digits
# (transformers' GGUF tokenizer splits digits differently from SmolLM2's own rule).
PAIRS = [("The capital of France is", " Paris"),
         ("Question: which animal barks?\nAnswer: ", "the dog, of course"),
         ("To be, or not to be, that is the", " question: whether 'tis nobler in the mind"),
         ("Once upon a time", ", there lived a king who had three daughters."),
         ("She sells sea shells by the sea ", "shore")]


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()


def harness_split(encode, context, continuation):
    """lm-evaluation-harness's _encode_pair (lm_eval/api/model.py at 4e7e0d4), written out."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole_enc, context_enc = encode(context + continuation), encode(context)
    return context_enc, whole_enc[len(context_enc):]


def test_split_is_the_harness_split_with_transformers_tokens(smollm2, hf_smollm2_tokenizer):
    _, tokenizer = smollm2
    hf_encode = lambda s: hf_smollm2_tokenizer.encode(s, add_special_tokens=False)
    for context, continuation in PAIRS:
        assert split_pair(tokenizer, context, continuation) == harness_split(
            hf_encode, context, continuation)
    ctx, cont = split_pair(tokenizer, "Answer: ", "yes")  # the space moves over
    assert tokenizer.decode(ctx) == "Answer:" and tokenizer.decode(cont) == " yes"


def test_continuation_logprobs_equal_transformers(smollm2, hf_model):
    model, tokenizer = smollm2
    contexts, continuations = zip(*PAIRS)
    ours, counts = continuation_logprobs(model, tokenizer, list(contexts), list(continuations),
                                         batch_size=2)  # padded batches of unequal lengths
    assert ours.shape == counts.shape == (len(PAIRS),) and ours.dtype == torch.float64
    for i, (context, continuation) in enumerate(PAIRS):
        ctx, cont = split_pair(tokenizer, context, continuation)
        with torch.no_grad():
            logits = hf_model(torch.tensor([ctx + cont])).logits[0]
        logp = F.log_softmax(logits.double(), -1)[len(ctx) - 1:-1]
        expected = logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()
        assert counts[i] == len(cont)
        assert ours[i].item() == pytest.approx(expected, abs=2e-3, rel=1e-4)
    one_by_one = [continuation_logprobs(model, tokenizer, c, [s])[0].item() for c, s in PAIRS]
    assert ours.tolist() == pytest.approx(one_by_one, abs=1e-4)


def test_bits_per_byte_equals_transformers_windows(smollm2, hf_model):
    model, tokenizer = smollm2
    text = "Now is the winter of our discontent made glorious summer by this sun of York."
    ids = tokenizer.encode(text)
    result = bits_per_byte(model, tokenizer, text, window=5)
    nats = 0.0
    for start in range(0, len(ids) - 1, 5):  # each window restarts from its first token
        chunk = torch.tensor([ids[start:start + 6]])
        with torch.no_grad():
            logits = hf_model(chunk[:, :-1]).logits.double()
        nats += F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
    first = len(tokenizer.decode(ids[:1]).encode())
    assert result.tokens == len(ids) - 1 and result.bytes == len(text.encode()) - first
    assert result.nats == pytest.approx(nats, rel=1e-4)
    assert result.bpb == pytest.approx(nats / math.log(2) / result.bytes, rel=1e-4)


def test_bits_per_byte_of_a_character_model_is_its_loss_over_ln2():
    torch.manual_seed(0)
    text = "to be or not to be, that is the question " * 4
    tokenizer = CharTokenizer.from_text(text)
    model = GPT(GPTConfig.tiny(vocab_size=tokenizer.vocab_size, context_length=16)).double()
    result = bits_per_byte(model, tokenizer, text)
    ids = torch.tensor(tokenizer.encode(text))
    chunks = [ids[s:s + 17] for s in range(0, len(ids) - 1, 16)]
    nats = sum(F.cross_entropy(model(c[None, :-1])[0][0], c[1:], reduction="sum").item()
               for c in chunks)
    assert result.tokens == result.bytes == len(text) - 1
    assert result.nats == pytest.approx(nats, rel=1e-6)
    # the bpb property: F.cross_entropy's nats / ln 2 / the UTF-8 bytes after the first
    assert result.bpb == pytest.approx(nats / math.log(2) / (len(text.encode()) - 1), rel=1e-6)


def test_long_pairs_keep_their_last_tokens():
    torch.manual_seed(0)
    tokenizer = CharTokenizer.from_text("abcdefgh ")
    model = GPT(GPTConfig.tiny(vocab_size=tokenizer.vocab_size, context_length=8))
    lp, counts = continuation_logprobs(model, tokenizer, "abcdefgh abc", ["defg", "h"])
    ids = torch.tensor(tokenizer.encode("abcdefgh abcdefg")[-9:])
    logp = F.log_softmax(model(ids[None, :-1])[0][0].double(), -1)
    assert counts.tolist() == [4, 1]
    assert lp[0].item() == pytest.approx(logp[-4:].gather(-1, ids[-4:, None]).sum().item(),
                                         abs=1e-5)


def test_pass_at_k_equals_enumerating_every_subset():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
                exact = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    # large n: the product form against exact integer arithmetic
    n, c, k = 500, 7, 100
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k),
                                               rel=1e-12)


def test_wilson_interval_equals_scipy():
    stats = pytest.importorskip("scipy.stats")
    for s, n, conf in [(0, 10, 0.95), (10, 10, 0.95), (7, 12, 0.95), (2, 12, 0.9),
                       (431, 1000, 0.99), (1, 3, 0.5)]:
        ci = stats.binomtest(s, n).proportion_ci(confidence_level=conf, method="wilson")
        assert wilson_interval(s, n, conf) == pytest.approx((ci.low, ci.high), abs=1e-10)


def test_mcnemar_equals_scipy_binomtest_on_discordant_pairs():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for trial in range(30):
        n, pa, pb = rng.randint(5, 200), rng.random(), rng.random()
        a = [rng.random() < pa for _ in range(n)]
        b = [rng.random() < pb for _ in range(n)]
        only_a, only_b, p = mcnemar_exact(a, b)
        assert only_a == sum(x and not y for x, y in zip(a, b))
        assert only_b == sum(y and not x for x, y in zip(a, b))
        expected = stats.binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1
        assert p == pytest.approx(expected, abs=1e-12)


def test_calibration_by_bins():
    ece, conf, acc, count = calibration(torch.tensor([0.75] * 4), torch.tensor([1, 1, 1, 0]))
    assert ece == pytest.approx(0.0) and count[7] == 4 and acc[7] == 0.75
    ece, *_ = calibration(torch.ones(10), torch.tensor([1, 0] * 5))
    assert ece == pytest.approx(0.5)
    rng = torch.Generator().manual_seed(0)
    c, y = torch.rand(300, generator=rng), torch.rand(300, generator=rng) < 0.6
    ece, *_ = calibration(c, y, bins=5)
    brute = 0.0
    for lo in (0.0, 0.2, 0.4, 0.6, 0.8):  # bin (lo, lo + 0.2]
        inside = (c > lo) & (c <= lo + 0.2)
        if inside.any():
            brute += inside.sum().item() / 300 * abs(y[inside].double().mean().item()
                                                     - c[inside].double().mean().item())
    assert ece == pytest.approx(brute, abs=1e-12)


def test_majority_vote():
    assert majority_vote(["3", "4", "4", None, "3", "4"]) == "4"
    assert majority_vote(["7", "5", "5", "7"]) == "7"  # a tie goes to the first seen
    assert majority_vote([None, None]) is None


@pytest.mark.parametrize("reply, strict, last", [
    ("12", 12, 12), (" 12", 12, 12), (" 12.", 12, 12), ("12 .", None, 12),
    ("-3", -3, -3), (" 5 + 7 = 12", None, 12), ("12 apples", None, 12),
    ("1.5", None, 5), ("", None, None), (" .", None, None), ("twelve", None, None),
    ("0012", 12, 12), ("12\n", 12, 12), ("12..", None, 12), ("3-4", None, -4),
    # any whitespace, any script's digits, only an ASCII minus sign
    ("\t12\u3000", 12, 12), ("\n12.\n", 12, 12), ("\u0661\u0662", 12, 12),
    ("\u221212", None, 12), ("12.5", None, 5), ("10,000", None, 0), ("2024-11-26", None, -26),
])
def test_number_rules_on_written_out_cases(reply, strict, last):
    assert strict_number(reply) == strict
    assert last_number(reply) == last


def test_number_rules_take_text_only():
    for rule in (strict_number, last_number):
        with pytest.raises(TypeError, match="reply must be a str"):
            rule(12)


def _last_number_by_scanning(reply: str):
    "The same rule as last_number, read right to left one character at a time."
    end = len(reply)
    while end and not reply[end - 1].isdigit():
        end -= 1
    if not end:
        return None
    start = end
    while start and reply[start - 1].isdigit():
        start -= 1
    sign = -1 if start and reply[start - 1] == "-" else 1
    return sign * int(reply[start:end])


def test_number_rules_on_random_replies():
    rng = random.Random(0)
    for _ in range(2000):
        reply = "".join(rng.choice("0123456789 -.+=ab\n\t") for _ in range(rng.randint(0, 9)))
        assert last_number(reply) == _last_number_by_scanning(reply), reply
        body = reply.strip()  # then at most one final full stop, then -?digits
        body = body[:-1] if body.endswith(".") else body
        digits = body[1:] if body.startswith("-") else body
        whole = digits.isdigit()
        assert strict_number(reply) == (int(body) if whole else None), reply


def test_bad_input_raises(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(ValueError, match="continuations"):
        continuation_logprobs(model, tokenizer, "context", [])
    with pytest.raises(ValueError, match="same length"):
        continuation_logprobs(model, tokenizer, ["a", "b"], ["x"])
    with pytest.raises(ValueError, match="encode to a token"):
        continuation_logprobs(model, tokenizer, "", ["x"])
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(5, 2, 6)
    with pytest.raises(ValueError, match="c must be"):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 10, 1.0)
    with pytest.raises(ValueError, match="two tokens"):
        bits_per_byte(model, tokenizer, "a")
    with pytest.raises(ValueError, match="window"):
        bits_per_byte(model, tokenizer, "a b c", window=0)
    with pytest.raises(ValueError, match="same items"):
        mcnemar_exact([True], [True, False])
