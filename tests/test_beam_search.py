"""lib.sampling.beam_search: exact on a tiny vocabulary, consistent log-probabilities, clear errors."""
import itertools
from types import SimpleNamespace

import pytest
import torch

from lib.model import GPT, GPTConfig
from lib.sampling import beam_search

pytestmark = pytest.mark.usefixtures("one_thread")


class TableModel(torch.nn.Module):
    """A stub language model: the next token's logits depend on the last two tokens (a random table)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = 2.0 * torch.randn(vocab_size, vocab_size, vocab_size, generator=g)  # (V, V, V)
        self.config = SimpleNamespace(vocab_size=vocab_size, context_length=None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)  # (N, T): the token before each one
        return self.table[prev, ids]  # (N, T, V)


def random_gpt(vocab_size: int = 3, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny(vocab_size=vocab_size, context_length=16, d_model=16, n_layers=1,
                               n_heads=2, d_ff=32))
    with torch.no_grad():  # larger weights than GPT-2's init: peaked, varied distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    return model.eval()


def score(model, prompt: torch.Tensor, new: list[int]) -> float:
    """log p(new | prompt) by teacher forcing: one forward pass over the whole sequence."""
    if not new:
        return 0.0
    seq = torch.cat([prompt, torch.tensor([new])], dim=1)
    out = model(seq)
    logits = out[0] if isinstance(out, tuple) else out
    logp = torch.log_softmax(logits[0].double(), dim=-1)  # (T, V)
    T = prompt.size(1)
    return sum(logp[T - 1 + i, t].item() for i, t in enumerate(new))


def gnmt_penalty(n: int, alpha: float) -> float:
    """Wu et al. 2016 (GNMT), eq. 14: lp(Y) = (5 + |Y|)^alpha / (5 + 1)^alpha."""
    return (5 + n) ** alpha / (5 + 1) ** alpha


def exhaustive(model, prompt, V, n, length_penalty=1.0, eos_id=None):
    """Best continuation over every sequence of n tokens (or shorter ones ending in eos_id),
    ranked by log p / lp with GNMT's length penalty lp."""
    candidates = []
    for length in range(1, n + 1):
        for seq in itertools.product(range(V), repeat=length):
            if eos_id is None:
                if length < n:
                    continue
            elif eos_id in seq[:-1] or (length < n and seq[-1] != eos_id):
                continue
            candidates.append(list(seq))
    scored = [(score(model, prompt, c), c) for c in candidates]
    return max(scored, key=lambda s: s[0] / gnmt_penalty(len(s[1]), length_penalty))


@pytest.mark.parametrize("make_model", [lambda: TableModel(3), lambda: random_gpt(3)])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_wide_enough_beam_equals_exhaustive_search(make_model, n):
    """A beam of V ** (n - 1) keeps every prefix until the last step, which ranks all V ** n."""
    model = make_model()
    prompt = torch.tensor([[0, 2, 1]])
    best_lp, best = exhaustive(model, prompt, 3, n)
    ids, log_prob = beam_search(model, prompt, beam_width=3 ** (n - 1), max_new_tokens=n)
    assert ids[0, :3].tolist() == prompt[0].tolist()
    assert ids[0, 3:].tolist() == best
    assert log_prob == pytest.approx(best_lp, abs=1e-6)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_wide_enough_beam_with_an_end_token_equals_exhaustive_search(length_penalty):
    model = TableModel(3, seed=4)
    prompt = torch.tensor([[1]])
    best_lp, best = exhaustive(model, prompt, 3, 4, length_penalty, eos_id=2)
    ids, log_prob = beam_search(model, prompt, 3 ** 3, 4, length_penalty=length_penalty, eos_id=2)
    assert ids[0, 1:].tolist() == best
    assert log_prob == pytest.approx(best_lp, abs=1e-6)


def test_length_penalty_decides_between_short_and_long_hypotheses():
    lengths = set()
    for seed in range(30):
        model = TableModel(3, seed=seed)
        for lp in (0.0, 3.0):
            ids, _ = beam_search(model, torch.tensor([[0]]), 81, 4, length_penalty=lp, eos_id=2)
            lengths.add((lp, ids.size(1) - 1))
    # a penalty of 0 ranks by raw log-probability (short wins often); 3 favours long sequences
    assert (0.0, 1) in lengths and (3.0, 4) in lengths


def test_beam_width_one_is_greedy_and_log_prob_is_the_sequence_score():
    model = random_gpt(5, seed=1)
    prompt = torch.tensor([[0, 1, 2, 3]])
    ids, log_prob = beam_search(model, prompt, beam_width=1, max_new_tokens=8)
    assert torch.equal(ids, model.generate(prompt, 8, temperature=0))
    assert log_prob == pytest.approx(score(model, prompt, ids[0, 4:].tolist()), abs=1e-5)
    wide_ids, wide_lp = beam_search(model, prompt, beam_width=4, max_new_tokens=8)
    assert wide_ids.shape == (1, 12)
    assert wide_lp == pytest.approx(score(model, prompt, wide_ids[0, 4:].tolist()), abs=1e-5)


def test_long_sequences_are_cropped_to_the_context_and_mode_is_restored():
    model = random_gpt(3).train()
    prompt = torch.zeros(1, 15, dtype=torch.long)
    ids, _ = beam_search(model, prompt, beam_width=2, max_new_tokens=5)  # 20 > context_length 16
    assert ids.shape == (1, 20) and model.training
    same, lp0 = beam_search(model, prompt, beam_width=2, max_new_tokens=0)
    assert torch.equal(same, prompt) and lp0 == 0.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0), "beam_width"),
    (dict(beam_width=2.0), "beam_width"),
    (dict(beam_width=True), "beam_width"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=1.5), "max_new_tokens"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(length_penalty=float("inf")), "length_penalty"),
    (dict(length_penalty="x"), "length_penalty"),
    (dict(eos_id=-1), "eos_id"),
    (dict(eos_id=3), "eos_id"),
    (dict(ids=torch.tensor([[0, 1], [1, 0]])), "ids"),
    (dict(ids=torch.tensor([0, 1])), "ids"),
    (dict(ids=torch.zeros(1, 0, dtype=torch.long)), "ids"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    args = dict(model=TableModel(3), ids=torch.tensor([[0, 1]]), beam_width=2, max_new_tokens=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        beam_search(**args)


def test_bad_types_are_clear_errors():
    with pytest.raises(TypeError, match="ids"):
        beam_search(TableModel(3), torch.tensor([[0.0, 1.0]]), 2, 2)
