"""Choosing the next token from the model's logits: greedy, temperature, top-k,
top-p (nucleus), min-p, a repetition penalty; beam search for the most likely
continuation.

Every function takes logits of shape ``(..., V)`` (usually ``(B, V)``: the last
position of each sequence). Filters return logits of the same shape with the removed
tokens set to ``-inf``, so that softmax gives them probability zero and the filters
compose in any order.
"""
from __future__ import annotations

import torch

from lib.checks import check_int, check_number, check_token_ids, eval_mode


def check_sampling_args(temperature: float = 1.0, top_k: int | None = None,
                        top_p: float | None = None, min_p: float | None = None,
                        repetition_penalty: float | None = None) -> None:
    """ValueError for a temperature < 0, a top_k < 1, a top_p outside (0, 1], a min_p
    outside [0, 1] or a repetition_penalty that is not > 0."""
    check_number("temperature", temperature, low=0)
    check_int("top_k", top_k, optional=True)
    check_number("top_p", top_p, 0, 1, low_open=True, optional=True)
    check_number("min_p", min_p, 0, 1, optional=True)
    check_number("repetition_penalty", repetition_penalty, low=0, low_open=True,
                 optional=True)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token: ``(..., V) -> (...)`` token ids."""
    return logits.argmax(dim=-1)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide logits by ``temperature > 0``: below 1 sharpens the distribution, above
    1 flattens it. Temperature 0 is the limit "always the most likely token": use
    :func:`greedy` for it."""
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row, set the rest to ``-inf``.

    Tokens tied with the k-th largest are kept too. ``k`` larger than the vocabulary
    keeps all.
    """
    k = min(k, logits.size(-1))
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability
    reaches ``p``.

    Sort tokens by probability; a token stays if the tokens ranked above it hold less
    than ``p`` of the mass. The most likely token always stays; ``p = 1`` keeps all.
    """
    if p == 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
    remove_sorted = mass_before >= p  # (..., V), in sorted order
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the tokens whose probability is at least ``p`` times the most likely
    token's; the rest become ``-inf``.

    Unlike top-p, the cut follows the model's confidence: a peaked distribution keeps
    few tokens, a flat one many. ``p = 0`` keeps everything; the most likely token
    always stays.
    """
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                          dim=-1)
    top = probs.amax(dim=-1, keepdim=True)  # (..., 1)
    return logits.masked_fill(probs < p * top, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor,
                             penalty: float) -> torch.Tensor:
    """Make the tokens in ``previous_ids`` less likely: Hugging Face's rule.

    For every token that appears in ``previous_ids`` (however often), a positive logit
    is divided by ``penalty`` and a negative one multiplied by it, so with
    ``penalty > 1`` the token always loses probability (as transformers'
    ``RepetitionPenaltyLogitsProcessor``). CTRL (Keskar et al. 2019), where the penalty
    comes from, divides every seen logit, which raises a negative one.
    ``logits`` ``(..., V)``; ``previous_ids`` ``(..., T)``, same leading dimensions.
    """
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen = seen.scatter(-1, previous_ids.long(), True)  # (..., V)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def sample_next(logits: torch.Tensor, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None, *,
                min_p: float | None = None, repetition_penalty: float | None = None,
                previous_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row: ``(..., V) -> (...)`` token ids.

    Order: the repetition penalty on the raw logits (needs ``previous_ids``, the tokens
    so far), then temperature, then the filters top-k, top-p and min-p, then a draw from
    the softmax. ``temperature=0`` means greedy (after the penalty; the filters never
    remove the most likely token). ``generator`` makes the draw reproducible; when it
    lives on another device than the logits (a CPU generator, a GPU model), the draw
    happens on the generator's device. It runs once per generated token, so it checks
    nothing: callers check the settings once (:func:`check_sampling_args`, as
    :meth:`lib.model.GPT.generate` does).
    """
    if repetition_penalty is not None and repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, previous_ids, repetition_penalty)
    if temperature == 0:
        return greedy(logits)
    logits = apply_temperature(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    if min_p is not None:
        logits = min_p_filter(logits, min_p)
    # Softmax in at least float32: bfloat16 probabilities are too coarse to sample from.
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                          dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    flat = probs.reshape(-1, probs.size(-1))  # (N, V)
    ids = torch.multinomial(flat, num_samples=1, generator=generator)  # (N, 1)
    return ids.reshape(probs.shape[:-1]).to(logits.device)


def check_beam_search_args(ids: torch.Tensor, beam_width: int, max_new_tokens: int,
                           length_penalty: float, eos_id: int | None,
                           vocab_size: int | None = None) -> None:
    """TypeError/ValueError unless ``ids`` is ``(1, T)`` integer ids with T >= 1, the
    beam width and token count are ints (>= 1, >= 0), the penalty is finite and
    ``eos_id`` is None or an id (below ``vocab_size`` when it is known)."""
    check_token_ids("ids", ids, dim=2)
    if ids.size(0) != 1 or ids.size(1) == 0:
        raise ValueError(f"ids must have shape (1, T), T >= 1, got {tuple(ids.shape)}")
    check_int("beam_width", beam_width)
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_number("length_penalty", length_penalty)
    top = None if vocab_size is None else vocab_size - 1
    check_int("eos_id", eos_id, minimum=0, maximum=top, optional=True)


@torch.no_grad()
def beam_search(model: torch.nn.Module, ids: torch.Tensor, beam_width: int,
                max_new_tokens: int, length_penalty: float = 1.0,
                eos_id: int | None = None) -> tuple[torch.Tensor, float]:
    """The most likely continuation of ``ids`` ``(1, T)`` that beam search finds.

    Each step extends every kept sequence (*beam*) by every token, scores a candidate by
    its summed log-probability and keeps the ``beam_width`` best. A candidate ending in
    ``eos_id`` is finished and leaves the beam. At the end all compete on GNMT's
    ``log_prob / ((5 + n) / 6) ** length_penalty`` (n new tokens). A beam as wide as
    ``V ** (max_new_tokens - 1)`` drops nothing: the search is then exact.
    ``model(ids)`` gives logits ``(N, T, V)`` or a tuple starting with them. Returns the
    prompt plus the chosen tokens, ``(1, T + n)``, and their summed log-probability.
    """
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    check_beam_search_args(ids, beam_width, max_new_tokens, length_penalty, eos_id,
                           vocab_size)
    ctx = getattr(config, "context_length", None)  # None: the model takes any length
    end = -1 if eos_id is None else eos_id  # -1 matches no token
    beams = ids  # (N, T + t): the unfinished sequences, best first
    scores = torch.zeros(1, dtype=torch.float64, device=ids.device)  # (N,) their log p
    finished = []  # (sequence, log p) of the sequences that ended with eos_id
    with eval_mode(model):  # dropout off
        for _ in range(max_new_tokens):
            out = model(beams if ctx is None else beams[:, -ctx:])
            logits = (out[0] if isinstance(out, tuple) else out)[:, -1]  # (N, V)
            logp = torch.log_softmax(logits.float(), dim=-1).double()  # (N, V)
            candidates = (scores[:, None] + logp).flatten()  # (N * V,)
            scores, flat = candidates.topk(min(beam_width, len(candidates)))  # (k,)
            parent, token = flat // logp.size(-1), flat % logp.size(-1)
            beams = torch.cat([beams[parent], token[:, None].to(beams.dtype)], dim=1)
            done = token == end  # (k,)
            finished += zip(beams[done], scores[done].tolist())
            beams, scores = beams[~done], scores[~done]
            if len(beams) == 0:  # every candidate ended
                break
    pool = finished + list(zip(beams, scores.tolist()))

    def normalised(item: tuple[torch.Tensor, float]) -> float:
        n_new = len(item[0]) - ids.size(1)
        return item[1] / ((5 + n_new) / 6) ** length_penalty

    sequence, log_prob = max(pool, key=normalised)
    return sequence[None], log_prob
