"""Speculative decoding: a small draft model guesses, the large target model checks.

A target model scores ``k`` guessed tokens in one forward pass about as cheaply as it
produces one token, when decoding is limited by reading its weights and cache. Each
round the draft proposes ``k`` tokens; the target keeps them through the rejection rule
of speculative sampling (:func:`speculative_accept`; Leviathan et al. 2023, Chen et al.
2023), which makes every emitted token distributed exactly as the target's own. Greedy
decoding is the same rule on one-hot distributions: a proposal is kept exactly when it
is the target's argmax.
"""
from __future__ import annotations

import torch
from torch import nn

from lib.checks import check_int, check_number, check_token_ids, eval_mode

__all__ = ["next_token_distribution", "speculative_accept", "speculative_decode"]


def next_token_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(..., V)`` logits -> float64 probabilities: softmax of ``logits /
    temperature``, or for ``temperature == 0`` (greedy) all the probability on the
    argmax."""
    if temperature == 0:
        one_hot = torch.zeros_like(logits, dtype=torch.float64)
        return one_hot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.softmax(logits.double() / temperature, dim=-1)


def speculative_accept(p: torch.Tensor, q: torch.Tensor, token: int,
                       generator: torch.Generator | None = None) -> tuple[bool, int]:
    """The rejection rule of speculative sampling for one proposed token.

    ``p`` and ``q`` are the target's and the draft's next-token distributions ``(V,)``;
    ``token`` was drawn from ``q``. It is kept with probability ``min(1, p[token] /
    q[token])``; otherwise a replacement is drawn from the residual ``max(p - q, 0)``
    (renormalised). Returns ``(accepted, token_out)``. Whatever ``q`` is, ``token_out``
    is distributed as ``p``.
    """
    u = torch.rand((), generator=generator, dtype=torch.float64)
    if u * q[token].double() < p[token].double():  # u < p/q, without dividing
        return True, token
    residual = (p.double() - q.double()).clamp(min=0)
    if residual.sum() <= 0:  # p == q: a rejection has probability 0; keep the token
        return True, token
    replacement = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return False, int(replacement)


def draft_tokens(draft: nn.Module, ids: torch.Tensor, n: int, temperature: float,
                 generator: torch.Generator | None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft extends ``ids (1, T)`` by ``n`` tokens, one call each. Returns the
    extended ids ``(1, T + n)`` and the draft's distribution for each proposal ``(n,
    V)``."""
    dists = []
    for _ in range(n):
        q = next_token_distribution(draft(ids)[0][0, -1], temperature)   # (V,)
        token = torch.multinomial(q, 1, generator=generator)            # (1,)
        ids = torch.cat([ids, token[None]], dim=1)
        dists.append(q)
    return ids, torch.stack(dists)


@torch.no_grad()
def speculative_decode(target: nn.Module, draft: nn.Module, ids: torch.Tensor,
                       max_new_tokens: int, k: int = 4, temperature: float = 0.0,
                       generator: torch.Generator | None = None,
                       ) -> tuple[torch.Tensor, dict[str, int]]:
    """Extend ``ids`` ``(1, T)`` by ``max_new_tokens`` tokens with speculative decoding.

    Each round the ``draft`` proposes ``k`` tokens; the ``target`` scores all of them in
    one forward pass and keeps them through :func:`speculative_accept` until the first
    rejection, which it replaces; if all are kept, its prediction after the last one
    comes for free. With ``temperature=0`` the output is exactly the target's greedy
    text, otherwise each token is distributed as the target's sample at that
    temperature. Models are called as ``model(ids) -> (logits (1, T, V), ...)`` on the
    whole sequence (no KV cache).

    Returns ``(ids (1, T + max_new_tokens), stats)``; ``stats`` counts ``rounds``
    (target passes), ``proposed`` and ``accepted`` draft tokens, and ``rejected`` ones: a
    round stops at its first rejection, so ``accepted + rejected`` proposals were checked.
    """
    _check_decode(target, draft, ids, max_new_tokens, k, temperature)
    stats = {"rounds": 0, "proposed": 0, "accepted": 0, "rejected": 0}
    goal = ids.size(1) + max_new_tokens
    with eval_mode(target), eval_mode(draft):
        while ids.size(1) < goal:
            T = ids.size(1)
            n = min(k, goal - T)                           # never propose past the goal
            proposal, q = draft_tokens(draft, ids, n, temperature, generator)
            logits = target(proposal)[0][0, T - 1:]        # (n + 1, V)
            p = next_token_distribution(logits, temperature)
            kept = []
            for i in range(n):
                token = int(proposal[0, T + i])
                accepted, token = speculative_accept(p[i], q[i], token, generator)
                kept.append(token)
                if not accepted:
                    break
            stats["accepted"] += len(kept) - (not accepted)
            stats["rejected"] += not accepted
            if accepted and T + n < goal:            # all kept: one more token, free
                kept.append(int(torch.multinomial(p[n], 1, generator=generator)))
            ids = torch.cat([ids, ids.new_tensor([kept])], dim=1)
            stats["rounds"] += 1
            stats["proposed"] += n
    return ids, stats


def _check_decode(target: object, draft: object, ids: object, max_new_tokens: object,
                  k: object, temperature: object) -> None:
    """TypeError/ValueError unless the arguments of :func:`speculative_decode` are
    usable."""
    check_token_ids("ids", ids, dim=2, nonempty=True)
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_int("k", k)
    check_number("temperature", temperature, low=0)
    contexts = [getattr(getattr(m, "config", None), "context_length", None)
                for m in (target, draft)]
    if ids.size(0) != 1 or any(isinstance(c, int) and ids.size(1) + max_new_tokens > c
                               for c in contexts):
        raise ValueError(f"ids must be one sequence (1, T) with T + max_new_tokens "
                         f"within both models' context_length {contexts}; got shape "
                         f"{tuple(ids.shape)}, max_new_tokens={max_new_tokens}")
