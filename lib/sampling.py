"""Choosing the next token from the model's logits: greedy, temperature, top-k, top-p (nucleus);
beam search for the most likely continuation.

Every function takes logits of shape ``(..., V)`` (usually ``(B, V)``: the last position of each
sequence). Filters return logits of the same shape with the removed tokens set to ``-inf``, so
that softmax gives them probability zero and the filters compose in any order.
"""
from __future__ import annotations

import torch

from lib.checks import check_id_range, check_int, check_number, check_token_ids


def check_sampling_args(temperature: float = 1.0, top_k: int | None = None,
                        top_p: float | None = None, min_p: float | None = None,
                        repetition_penalty: float | None = None) -> None:
    """Raise ValueError for a temperature < 0, a top_k < 1, a top_p outside (0, 1], a min_p outside
    [0, 1] or a repetition_penalty that is not > 0."""
    check_number("temperature", temperature, low=0)
    check_int("top_k", top_k, optional=True)
    check_number("top_p", top_p, 0, 1, low_open=True, optional=True)
    check_number("min_p", min_p, 0, 1, optional=True)
    check_number("repetition_penalty", repetition_penalty, low=0, low_open=True, optional=True)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token: ``(..., V) -> (...)`` token ids."""
    return logits.argmax(dim=-1)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide logits by ``temperature > 0``: below 1 sharpens the distribution, above 1 flattens it.

    Temperature 0 is the limit "always the most likely token": use :func:`greedy` for it.
    """
    check_number("temperature", temperature, low=0)
    if temperature == 0:
        raise ValueError("temperature must be > 0 in apply_temperature; temperature 0 is greedy(logits)")
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row, set the rest to ``-inf``.

    Tokens tied with the k-th largest are kept too. ``k`` larger than the vocabulary keeps all.
    """
    check_int("top_k", k)
    k = min(k, logits.size(-1))
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches ``p``.

    Sort tokens by probability; a token stays if the tokens ranked above it hold less than ``p`` of
    the mass. The most likely token always stays; ``p = 1`` keeps everything.
    """
    check_number("top_p", p, 0, 1, low_open=True)
    if p == 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    remove_sorted = mass_before >= p  # (..., V), in sorted order
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the tokens whose probability is at least ``p`` times the most likely token's; the rest
    become ``-inf``.

    Unlike top-p, the cut follows the model's confidence: a peaked distribution keeps few tokens, a
    flat one many. ``p = 0`` keeps everything; the most likely token always stays.
    """
    check_number("min_p", p, 0, 1)
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top = probs.amax(dim=-1, keepdim=True)  # (..., 1)
    return logits.masked_fill(probs < p * top, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor,
                             penalty: float) -> torch.Tensor:
    """Make the tokens in ``previous_ids`` less likely (the CTRL rule, Keskar et al. 2019).

    For every token that appears in ``previous_ids`` (however often), a positive logit is divided
    by ``penalty`` and a negative one multiplied by it, so with ``penalty > 1`` the token always
    loses probability. ``penalty = 1`` changes nothing; below 1 favours repeats.
    ``logits`` ``(..., V)``; ``previous_ids`` ``(..., T)`` with the same leading dimensions.
    """
    check_number("penalty", penalty, low=0, low_open=True)
    check_token_ids("previous_ids", previous_ids)
    if previous_ids.shape[:-1] != logits.shape[:-1] or previous_ids.dim() < 1:
        raise ValueError(f"previous_ids must have shape {tuple(logits.shape[:-1])} + (T,) (the logits' "
                         f"leading dimensions), got {tuple(previous_ids.shape)}")
    check_id_range("previous_ids", previous_ids, logits.size(-1))
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, previous_ids.long(), True)  # (..., V)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None, *,
                min_p: float | None = None, repetition_penalty: float | None = None,
                previous_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row: ``(..., V) -> (...)`` token ids.

    Order: the repetition penalty on the raw logits (needs ``previous_ids``, the tokens so far),
    then temperature, then the filters top-k, top-p and min-p, then a draw from the softmax.
    ``temperature=0`` means greedy (after the repetition penalty; the filters never remove the most
    likely token, so they do not matter then). ``generator`` makes the draw reproducible; when it
    lives on another device than the logits (a CPU generator with a GPU model), the draw happens on
    the generator's device.
    """
    check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
    if repetition_penalty is not None and repetition_penalty != 1.0:
        if previous_ids is None:
            raise ValueError("repetition_penalty needs previous_ids (the tokens generated so far)")
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
    # Softmax in at least float32: probabilities summed in bfloat16 are too coarse to sample from.
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    flat = probs.reshape(-1, probs.size(-1))  # (N, V)
    ids = torch.multinomial(flat, num_samples=1, generator=generator)  # (N, 1)
    return ids.reshape(probs.shape[:-1]).to(logits.device)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@torch.no_grad()
def beam_search(model: torch.nn.Module, ids: torch.Tensor, beam_width: int, max_new_tokens: int,
                length_penalty: float = 1.0, eos_id: int | None = None) -> tuple[torch.Tensor, float]:
    """The most likely continuation of ``ids`` ``(1, T)`` that beam search finds, and its log-probability.

    ``model(x)`` maps ids ``(N, T)`` to logits ``(N, T, V)`` (or to a tuple whose first item is
    them, like :class:`lib.model.GPT`). Each step extends every kept sequence (*beam*) by every token,
    scores a candidate by the sum of its tokens' log-probabilities and keeps the ``beam_width`` best.
    A candidate that ends with ``eos_id`` is finished and leaves the beam. At the end the finished
    and the unfinished sequences compete on ``log_prob / n_new ** length_penalty`` (``n_new`` = number
    of new tokens, end token included); without ``eos_id`` all have the same length and the highest
    log-probability wins. With ``beam_width >= V ** max_new_tokens`` nothing is ever dropped, so the
    result is what an exhaustive search over all continuations returns.

    Returns ``(ids (1, T + n_new), log_prob)``: the prompt followed by the chosen tokens, and the sum
    of the chosen tokens' log-probabilities (a float, not length-normalised). A model with a
    ``config.context_length`` sees at most that many of the latest tokens. Runs in eval mode.
    """
    if not callable(model):
        raise TypeError(f"model must be callable (ids -> logits), got {type(model).__name__}")
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor of token ids, got "
                        f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if ids.dim() != 2 or ids.size(0) != 1 or ids.size(1) == 0:
        raise ValueError(f"ids must have shape (1, T) with T >= 1 (a batch of one), got {tuple(ids.shape)}")
    if not _is_int(beam_width) or beam_width < 1:
        raise ValueError(f"beam_width must be an int >= 1, got {beam_width!r}")
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if (not isinstance(length_penalty, (int, float)) or isinstance(length_penalty, bool)
            or not abs(length_penalty) < float("inf")):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if eos_id is not None and (not _is_int(eos_id) or eos_id < 0):
        raise ValueError(f"eos_id must be None or an int >= 0, got {eos_id!r}")

    config = getattr(model, "config", None)
    ctx = getattr(config, "context_length", None)
    was_training = getattr(model, "training", None)
    if was_training:
        model.eval()
    try:
        beams = ids  # (N, T + t): the unfinished sequences, best first
        scores = torch.zeros(1, dtype=torch.float64, device=ids.device)  # (N,) their log-probabilities
        finished: list[tuple[torch.Tensor, float]] = []  # (sequence (T + n,), log-probability)
        for _ in range(max_new_tokens):
            out = model(beams if ctx is None else beams[:, -ctx:])
            logits = out[0] if isinstance(out, (tuple, list)) else out  # (N, T', V)
            last = logits[:, -1, :]
            logp = torch.log_softmax(last.to(torch.promote_types(last.dtype, torch.float32)), dim=-1)
            V = logp.size(-1)
            if eos_id is not None and eos_id >= V:
                raise ValueError(f"eos_id must be < the vocabulary size {V}, got {eos_id}")
            candidates = scores[:, None] + logp.to(torch.float64)  # (N, V)
            best, flat = torch.topk(candidates.flatten(), min(beam_width, candidates.numel()))
            parent, token = flat // V, flat % V
            grown = torch.cat([beams[parent], token[:, None].to(beams.dtype)], dim=1)  # (k, T + t + 1)
            done = token == eos_id if eos_id is not None else torch.zeros_like(token, dtype=torch.bool)
            finished += [(grown[i], best[i].item()) for i in done.nonzero().flatten().tolist()]
            beams, scores = grown[~done], best[~done]
            if beams.size(0) == 0:
                break
        n_prompt = ids.size(1)
        pool = finished + [(beams[i], scores[i].item()) for i in range(beams.size(0))]

        def rank(item: tuple[torch.Tensor, float]) -> float:
            n_new = item[0].numel() - n_prompt
            return item[1] if n_new == 0 else item[1] / n_new ** length_penalty

        sequence, log_prob = max(pool, key=rank)
    finally:
        if was_training:
            model.train()
    return sequence[None, :], float(log_prob)
