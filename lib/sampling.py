"""Choosing the next token from the model's logits: greedy, temperature, top-k, top-p (nucleus).

Every function takes logits of shape ``(..., V)`` (usually ``(B, V)``: the last position of each
sequence). Filters return logits of the same shape with the removed tokens set to ``-inf``, so
that softmax gives them probability zero and the filters compose in any order.
"""
from __future__ import annotations

import torch


def check_sampling_args(temperature: float = 1.0, top_k: int | None = None,
                        top_p: float | None = None) -> None:
    """Raise ValueError for a temperature < 0, a top_k < 1 or a top_p outside (0, 1]."""
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or isinstance(top_p, bool)
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token: ``(..., V) -> (...)`` token ids."""
    return logits.argmax(dim=-1)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide logits by ``temperature > 0``: below 1 sharpens the distribution, above 1 flattens it.

    Temperature 0 is the limit "always the most likely token": use :func:`greedy` for it.
    """
    check_sampling_args(temperature=temperature)
    if temperature == 0:
        raise ValueError("temperature must be > 0 in apply_temperature; temperature 0 is greedy(logits)")
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row, set the rest to ``-inf``.

    Tokens tied with the k-th largest are kept too. ``k`` larger than the vocabulary keeps all.
    """
    check_sampling_args(top_k=k)
    k = min(k, logits.size(-1))
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches ``p``.

    Sort tokens by probability; a token stays if the tokens ranked above it hold less than ``p`` of
    the mass. The most likely token always stays; ``p = 1`` keeps everything.
    """
    check_sampling_args(top_p=p)
    if p == 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    remove_sorted = mass_before >= p  # (..., V), in sorted order
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row: ``(..., V) -> (...)`` token ids.

    Order: temperature, then top-k, then top-p, then a draw from the softmax. ``temperature=0``
    means greedy. ``generator`` makes the draw reproducible; when it lives on another device than
    the logits (a CPU generator with a GPU model), the draw happens on the generator's device.
    """
    check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        return greedy(logits)
    logits = apply_temperature(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    # Softmax in at least float32: probabilities summed in bfloat16 are too coarse to sample from.
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    flat = probs.reshape(-1, probs.size(-1))  # (N, V)
    ids = torch.multinomial(flat, num_samples=1, generator=generator)  # (N, 1)
    return ids.reshape(probs.shape[:-1]).to(logits.device)
