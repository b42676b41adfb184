"""The GPT model: embeddings, a stack of blocks, a final norm, an output head.

    ids (B, T) -> token embeddings (+ positions) -> n_layers x TransformerBlock
        -> norm_f -> lm_head -> logits (B, T, V)

The architecture comes from a :class:`lib.config.GPTConfig` (importable from here too,
as ``lib.model.GPTConfig``). :class:`GPT` computes logits and the loss, generates text
(with or without a KV cache, for a batch of prompts, up to a stop token) and counts its
parameters by component; :func:`left_pad` batches prompts of different lengths and
:func:`completions` cuts each row's new tokens out of the result;
:func:`attention_maps` returns every layer's attention weights, for plots.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lib.attention import KVCache, attention_weights
from lib.block import TransformerBlock, make_norm
from lib.checks import check_id_range, check_int, check_token_ids, check_type, eval_mode
from lib.config import GPTConfig
from lib.norms import LayerNorm, RMSNorm
from lib.positional import (LearnedPositionalEmbedding, RotaryEmbedding,
                            SinusoidalPositionalEncoding, padded_positions)
from lib.sampling import check_sampling_args, sample_next

__all__ = ["COMPONENTS", "GPT", "GPTConfig", "RESIDUAL_PROJECTIONS", "attention_maps",
           "check_generate_args", "completions", "gpt2_init", "left_pad"]

# Projections that write into the residual stream: GPT-2 scales their initial weights
# by 1/sqrt(2 * n_layers), so the stream's variance does not grow with depth (two writes
# per block).
RESIDUAL_PROJECTIONS = ("attn.out_proj.weight", "ffn.fc_out.weight",
                        "ffn.w_down.weight")
# The components GPT.parameter_counts reports, by a part of the parameter's name.
COMPONENTS = {"tok_emb.": "embeddings", "pos_emb.": "positions", ".attn.": "attention",
              ".ffn.": "ffn", "norm": "norms", "lm_head.": "head"}


class GPT(nn.Module):
    """A decoder-only transformer language model: ``tok_emb``, ``pos_emb`` (or None),
    ``blocks``, ``norm_f``, ``lm_head``, built exactly as ``config`` says."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = check_type("config", config, GPTConfig, "GPTConfig")
        C, ctx = config.d_model, config.context_length
        self.tok_emb = nn.Embedding(config.vocab_size, C)
        self.pos_emb: nn.Module | None = None
        if config.positions == "learned":
            self.pos_emb = LearnedPositionalEmbedding(ctx, C)
        elif config.positions == "sinusoidal":
            self.pos_emb = SinusoidalPositionalEncoding(ctx, C)
        self.drop = nn.Dropout(config.dropout)
        rope = None  # one rotary embedding, shared by every block's attention
        if config.positions == "rope":
            rope = RotaryEmbedding(config.head_dim, config.rope_base,
                                   config.rope_scaling, ctx)
        self.blocks = nn.ModuleList(TransformerBlock(config, rope)
                                    for _ in range(config.n_layers))
        self.norm_f = make_norm(config)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        if config.tie_embeddings:  # one matrix reads tokens in and writes them out
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation, :func:`gpt2_init`."""
        gpt2_init(self)

    def embed(self, ids: torch.Tensor, offset: int = 0,
              n_pad: torch.Tensor | None = None) -> torch.Tensor:
        """The first block's input, ``(B, T) -> (B, T, C)``: token embeddings plus
        (learned or sinusoidal) positions ``offset … offset+T-1`` (``offset``: the
        tokens before ``ids``, e.g. in a KV cache; RoPE rotates q and k instead), or
        with ``n_pad`` ``(B,)`` each left-padded row's :func:`padded_positions`."""
        T, ctx = ids.size(1), self.config.context_length
        if offset + T > ctx:  # the one check of the model's own limit, a Python compare
            raise ValueError(f"sequence of {offset + T} tokens is longer than "
                             f"context_length={ctx}; crop ids to the last {ctx} tokens")
        x = self.tok_emb(ids)  # (B, T) -> (B, T, C)
        if self.pos_emb is not None:  # (T, C), broadcast over the batch, or (B, T, C)
            pos = (self.pos_emb(T, offset) if n_pad is None  # padded: rows of the table
                   else self.pos_emb(offset + T)[padded_positions(T, offset, n_pad)])
            x = x + pos.to(x.dtype)
        return self.drop(x)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None,
                kv_caches: list[KVCache] | None = None,
                attention_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, V)``, and the loss when ``targets`` ``(B, T)`` is given (else
        None): ``F.cross_entropy`` in at least float32 (targets -100 left out). With
        ``kv_caches`` (one :class:`KVCache` per block), ``ids`` continues the cached
        sequence, whose length is its first position. ``attention_mask`` ``(B, T_k)``
        (cached and new tokens), 0 on left padding: hidden; positions start after it."""
        offset = 0 if kv_caches is None else kv_caches[0].length  # ids[:, 0]'s position
        n_pad = None if attention_mask is None else (attention_mask == 0).sum(1)  # (B,)
        x = self.embed(ids, offset, n_pad)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, offset, None if kv_caches is None else kv_caches[i], n_pad)
        logits = self.lm_head(self.norm_f(x))  # (B, T, C) -> (B, T, V)
        if targets is None:
            return logits, None
        V = logits.size(-1)  # in at least float32: bfloat16 log-probs are too coarse
        logits32 = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(logits32.reshape(-1, V), targets.reshape(-1).long())
        return logits, loss

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 use_cache: bool = True, generator: torch.Generator | None = None,
                 min_p: float | None = None, repetition_penalty: float | None = None,
                 stop_id: int | None = None, attention_mask: torch.Tensor | None = None,
                 pad_id: int | None = None) -> torch.Tensor:
        """``ids`` ``(B, T)`` extended by up to ``max_new_tokens`` tokens, each drawn by
        :func:`lib.sampling.sample_next` from the last position's logits, in eval mode.
        With ``use_cache`` later steps read earlier keys and values from a KV cache;
        past ``context_length`` tokens, each step recomputes on the last ones. Batches
        of prompts come left-padded, with their ``attention_mask`` (:func:`left_pad`).
        A row that draws ``stop_id`` grows by ``pad_id`` (default ``stop_id``) from then
        on; all stopped, generation ends. :func:`completions` gives the new tokens."""
        check_generate_args(self, ids, max_new_tokens, stop_id, attention_mask, pad_id)
        check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
        ctx, mask = self.config.context_length, attention_mask
        pad = stop_id if pad_id is None else pad_id  # what a stopped row grows by
        caches = [KVCache() for _ in self.blocks] if use_cache else None
        stopped = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)  # (B,)
        with eval_mode(self):
            for _ in range(max_new_tokens):
                if caches is not None and ids.size(1) > ctx:
                    caches = None  # the cache is full: from now on recompute on a crop
                start = -ctx if caches is None else caches[0].length
                logits, _ = self(ids[:, start:], kv_caches=caches, attention_mask=(
                    None if mask is None else mask[:, -ctx:]))  # (B, T', V)
                seen = ids if mask is None else ids.where(mask == 1, ids[:, -1:])
                next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p,
                                      generator, min_p=min_p, previous_ids=seen,
                                      repetition_penalty=repetition_penalty)  # (B,)
                if stop_id is not None:  # a row that has stopped grows by padding
                    next_id = next_id.masked_fill(stopped, pad)
                    stopped = stopped | (next_id == stop_id)
                ids = torch.cat([ids, next_id[:, None].to(ids.dtype)], dim=1)
                mask = None if mask is None else F.pad(mask, (0, 1), value=1)  # a token
                if stop_id is not None and bool(stopped.all()):
                    break
        return ids

    def num_parameters(self) -> int:
        """Number of trainable parameters; a tied embedding/head matrix counts once."""
        return sum(p.numel() for p in self.parameters())

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by :data:`COMPONENTS`; a tied head counts once, in ``tok_emb``."""
        counts = dict.fromkeys(COMPONENTS.values(), 0)
        for name, p in self.named_parameters():  # the first matching part of the name
            counts[next(c for part, c in COMPONENTS.items() if part in name)] += p.numel()
        return counts


def check_generate_args(model: GPT, ids: torch.Tensor, max_new_tokens: int,
                        stop_id: int | None = None,
                        attention_mask: torch.Tensor | None = None,
                        pad_id: int | None = None) -> None:
    """TypeError/ValueError unless ``ids`` is ``(B, T)`` integer ids (T >= 1) below
    ``model``'s vocabulary size, ``max_new_tokens`` an int >= 0, ``stop_id`` and
    ``pad_id`` None or such ids, and ``attention_mask`` None or a tensor of ``ids``'
    shape and device holding 1 on tokens and 0 on padding, with every row's padding on
    the left (before its first token) and at least one token per row."""
    V = model.config.vocab_size
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_token_ids("ids", ids, dim=2, nonempty=True)
    check_id_range("ids", ids, V)
    for name, value in (("stop_id", stop_id), ("pad_id", pad_id)):
        check_int(name, value, minimum=0, maximum=V - 1, optional=True)
    mask = check_type("attention_mask", attention_mask, torch.Tensor, optional=True)
    if mask is None:
        return
    ok = mask.shape == ids.shape and mask.device == ids.device
    ok = ok and bool(((mask == 0) | (mask == 1)).all())  # 0s and 1s only
    ok = ok and bool((mask.long().diff(dim=1) >= 0).all() and mask[:, -1].all())
    if not ok:
        raise ValueError(f"attention_mask must have ids' shape {tuple(ids.shape)} and "
                         f"device {ids.device}, 1 on tokens and 0 on left padding only "
                         f"(each row's 0s before its first 1, at least one 1 per row); "
                         f"got shape {tuple(mask.shape)} on {mask.device}")


def left_pad(prompts: Sequence[Sequence[int] | torch.Tensor], pad_id: int = 0,
             device: torch.device | str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one batch for :meth:`GPT.generate`: ``ids``
    ``(B, T)``, T the longest prompt's length, each prompt at the right end of its row
    after ``pad_id`` tokens, and ``attention_mask`` ``(B, T)``, 1 on the prompt's
    tokens and 0 on the padding (as a transformers tokenizer with
    ``padding_side="left"`` makes them). Both are int64, on ``device``."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of prompts, got {prompts}")
    check_int("pad_id", pad_id, minimum=0)
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        prompt = torch.as_tensor(prompt, dtype=None if len(prompt) else torch.long)
        check_token_ids(f"prompts[{row}]", prompt, dim=1, nonempty=True)
        ids[row, T - len(prompt):], mask[row, T - len(prompt):] = prompt, 1
    return ids.to(device), mask.to(device)


def completions(out: torch.Tensor, prompt_length: int,
                stop_id: int | None = None) -> list[list[int]]:
    """Each row's new tokens in ``out`` ``(B, T)`` from :meth:`GPT.generate`: those
    after the first ``prompt_length`` (the prompt batch's width), up to and including
    the first ``stop_id`` (a row ends with it exactly when it stopped); the padding
    after it is dropped."""
    check_int("prompt_length", prompt_length, minimum=0, maximum=out.size(1))
    rows = out[:, prompt_length:].tolist()
    return [row[:row.index(stop_id) + 1] if stop_id in row else row for row in rows]


def gpt2_init(model: GPT) -> None:
    """GPT-2 initialisation of ``model``: weights N(0, 0.02), biases 0, norms 1,
    residual projections (:data:`RESIDUAL_PROJECTIONS`, and each expert's ``w_down``)
    scaled by 1/sqrt(2 n_layers)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, (LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
        if isinstance(module, (nn.Linear, LayerNorm)) and module.bias is not None:
            nn.init.zeros_(module.bias)
    std = 0.02 / math.sqrt(2 * model.config.n_layers)
    for name, p in model.blocks.named_parameters():
        expert_out = ".ffn.experts." in name and name.endswith(".w_down.weight")
        if name.endswith(RESIDUAL_PROJECTIONS) or expert_out:
            nn.init.normal_(p, mean=0.0, std=std)


@torch.no_grad()
def attention_maps(model: GPT, ids: torch.Tensor) -> list[torch.Tensor]:
    """Attention weights of every layer of ``model`` on ``ids`` ``(B, T)``, each
    ``(B, H, T, T)`` (rows sum to 1), from the written-out formula
    (:func:`lib.attention.attention_weights`), in eval mode. For plots."""
    check_token_ids("ids", ids, dim=2, nonempty=True)
    maps = []
    with eval_mode(model):
        x = model.embed(ids)
        for block in model.blocks:
            maps.append(attention_weights(block.attn, block.norm1(x)))
            x = block(x)
    return maps
