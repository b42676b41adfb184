"""The GPT model: embeddings, a stack of blocks, a final norm, an output head.

    ids (B, T) -> token embeddings (+ positions) -> n_layers x TransformerBlock
        -> norm_f -> lm_head -> logits (B, T, V)

The architecture comes from a :class:`lib.config.GPTConfig` (importable from here too,
as ``lib.model.GPTConfig``). :class:`GPT` computes logits and the loss, generates text
(with or without a KV cache) and counts its parameters by component;
:func:`attention_maps` returns every layer's attention weights, for plots.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lib.attention import KVCache, attention_weights
from lib.block import TransformerBlock, make_norm
from lib.checks import check_id_range, check_int, check_token_ids, check_type, eval_mode
from lib.config import GPTConfig
from lib.norms import LayerNorm, RMSNorm
from lib.positional import (LearnedPositionalEmbedding, RotaryEmbedding,
                            SinusoidalPositionalEncoding)
from lib.sampling import check_sampling_args, sample_next

__all__ = ["COMPONENTS", "GPT", "GPTConfig", "RESIDUAL_PROJECTIONS", "attention_maps"]

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
        """GPT-2 initialisation: weights N(0, 0.02), biases 0, norms 1, residual
        projections scaled by 1/sqrt(2 n_layers)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, (LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
            if isinstance(module, (nn.Linear, LayerNorm)) and module.bias is not None:
                nn.init.zeros_(module.bias)
        std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.blocks.named_parameters():
            expert_out = ".ffn.experts." in name and name.endswith(".w_down.weight")
            if name.endswith(RESIDUAL_PROJECTIONS) or expert_out:
                nn.init.normal_(p, mean=0.0, std=std)

    def embed(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The first block's input, ``(B, T) -> (B, T, C)``: token embeddings plus
        (learned or sinusoidal) positions ``offset … offset+T-1`` (``offset``: the
        tokens before ``ids``, e.g. in a KV cache; RoPE rotates q and k instead)."""
        T, ctx = ids.size(1), self.config.context_length
        if offset + T > ctx:  # the one check of the model's own limit, a Python compare
            raise ValueError(f"sequence of {offset + T} tokens is longer than "
                             f"context_length={ctx}; crop ids to the last {ctx} tokens")
        x = self.tok_emb(ids)  # (B, T) -> (B, T, C)
        if self.pos_emb is not None:  # (T, C) broadcasts over the batch
            x = x + self.pos_emb(T, offset).to(x.dtype)
        return self.drop(x)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None,
                kv_caches: list[KVCache] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, V)``, and the loss when ``targets`` ``(B, T)`` is given (else
        None): ``F.cross_entropy`` in at least float32 (targets -100 left out). With
        ``kv_caches`` (one :class:`KVCache` per block), ``ids`` continues the cached
        sequence, whose length is its first position."""
        offset = 0 if kv_caches is None else kv_caches[0].length  # ids[:, 0]'s position
        x = self.embed(ids, offset)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, offset, None if kv_caches is None else kv_caches[i])
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
                 min_p: float | None = None,
                 repetition_penalty: float | None = None) -> torch.Tensor:
        """``ids`` ``(B, T)`` extended by ``max_new_tokens`` tokens, each drawn by
        :func:`lib.sampling.sample_next` from the last position's logits, in eval mode.
        With ``use_cache`` later steps read earlier keys and values from a KV cache;
        past ``context_length`` tokens, each step recomputes on the last ones."""
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
        check_token_ids("ids", ids, dim=2, nonempty=True)
        check_id_range("ids", ids, self.config.vocab_size)
        ctx = self.config.context_length
        caches = [KVCache() for _ in self.blocks] if use_cache else None
        with eval_mode(self):
            for _ in range(max_new_tokens):
                if caches is not None and ids.size(1) > ctx:
                    caches = None  # the cache is full: from now on recompute on a crop
                start = -ctx if caches is None else caches[0].length
                logits, _ = self(ids[:, start:], kv_caches=caches)  # (B, T', V)
                next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p,
                                      generator, min_p=min_p, previous_ids=ids,
                                      repetition_penalty=repetition_penalty)  # (B,)
                ids = torch.cat([ids, next_id[:, None].to(ids.dtype)], dim=1)
        return ids

    def num_parameters(self) -> int:
        """Number of trainable parameters; a tied embedding/head matrix counts once."""
        return sum(p.numel() for p in self.parameters())

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by :data:`COMPONENTS`, summing to :meth:`num_parameters` (``head``
        is 0 when tied to the embeddings: a tied matrix counts once, as ``tok_emb``)."""
        counts = dict.fromkeys(COMPONENTS.values(), 0)
        for name, p in self.named_parameters():  # the first matching part of the name
            counts[next(c for part, c in COMPONENTS.items() if part in name)] += p.numel()
        return counts


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
