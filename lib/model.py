"""The GPT model: embeddings, a stack of blocks, a final norm, an output head.

    ids (B, T) -> token embeddings (+ positions) -> n_layers x TransformerBlock
        -> norm_f -> lm_head -> logits (B, T, V)

The architecture comes from a :class:`lib.config.GPTConfig` (importable from here too,
as ``lib.model.GPTConfig``). :class:`GPT` computes logits and the loss, generates text
(with or without a KV cache), returns attention maps for plots, and counts its
parameters by component.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from lib.attention import KVCache, attention_weights
from lib.block import TransformerBlock, make_norm
from lib.checks import check_id_range, check_int, check_token_ids, check_type, eval_mode
from lib.config import GPTConfig
from lib.loss import cross_entropy
from lib.norms import LayerNorm, RMSNorm
from lib.positional import (LearnedPositionalEmbedding, RotaryEmbedding,
                            SinusoidalPositionalEncoding)
from lib.sampling import check_sampling_args, sample_next

__all__ = ["GPT", "GPTConfig", "RESIDUAL_PROJECTIONS"]

# Projections that write into the residual stream: GPT-2 scales their initial weights
# by 1/sqrt(2 * n_layers), so the stream's variance does not grow with depth (two writes
# per block).
RESIDUAL_PROJECTIONS = ("attn.out_proj.weight", "ffn.fc_out.weight",
                        "ffn.w_down.weight")


class GPT(nn.Module):
    """A decoder-only transformer language model: ``tok_emb``, ``pos_emb`` (or None),
    ``blocks``, ``norm_f``, ``lm_head``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        check_type("config", config, GPTConfig, "GPTConfig")
        self.config = config
        self.fused = True  # the loss through F.cross_entropy; see set_fused
        C = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, C)
        self.pos_emb: nn.Module | None = None
        if config.positions == "learned":
            self.pos_emb = LearnedPositionalEmbedding(config.context_length, C)
        elif config.positions == "sinusoidal":
            self.pos_emb = SinusoidalPositionalEncoding(config.context_length, C)
        self.drop = nn.Dropout(config.dropout)
        rope = None  # one rotary embedding, shared by every block's attention
        if config.positions == "rope":
            rope = RotaryEmbedding(config.head_dim, config.rope_base,
                                   config.rope_scaling, config.context_length)
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
        """The input of the first block: token embeddings plus (learned or sinusoidal)
        positions ``offset … offset+T-1``, after dropout, ``(B, T) -> (B, T, C)``.

        ``offset`` is the position of ``ids[:, 0]`` (the number of tokens before it, e.g.
        in a KV cache). RoPE models add no positions here: their attention rotates
        queries and keys instead."""
        T = ids.size(1)
        if offset + T > self.config.context_length:
            ctx = self.config.context_length
            raise ValueError(f"sequence of {offset + T} tokens is longer than "
                             f"context_length={ctx}; crop ids to the last {ctx} tokens")
        x = self.tok_emb(ids)  # (B, T) -> (B, T, C)
        if self.pos_emb is not None:  # (T, C) broadcasts over the batch
            x = x + self.pos_emb(T, offset).to(x.dtype)
        return self.drop(x)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None,
                kv_caches: list[KVCache] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, V)`` for every position, and the cross-entropy loss when
        ``targets`` ``(B, T)`` is given (else None).

        With ``kv_caches`` (one :class:`KVCache` per block), ``ids`` continues the
        cached sequence: its positions start at the cache length (computed here once and
        handed to :meth:`embed` and every block) and the caches grow by ``T``.

        Mixture of experts (``config.ffn='moe'``): in training mode the returned loss is
        the cross-entropy plus ``config.aux_weight`` times the sum over layers of each
        layer's load-balancing loss (``block.ffn.aux_loss``), so
        :func:`lib.training.train` optimises both; in eval mode (``evaluate``,
        validation) it is the cross-entropy alone.
        """
        offset = 0 if kv_caches is None else kv_caches[0].length  # position of ids[:, 0]
        x = self.embed(ids, offset)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, offset, None if kv_caches is None else kv_caches[i])
        logits = self.lm_head(self.norm_f(x))  # (B, T, C) -> (B, T, V)
        if targets is None:
            return logits, None
        loss = cross_entropy(logits, targets, fused=self.fused)
        if self.training and self.config.aux_weight > 0:
            aux = torch.stack([block.ffn.aux_loss for block in self.blocks]).sum()
            loss = loss + self.config.aux_weight * aux
        return logits, loss

    @torch.no_grad()
    def attention_maps(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Attention weights of every layer, each ``(B, H, T, T)`` (rows sum to 1), from
        the written-out formula (:func:`lib.attention.attention_weights`), in eval mode.
        """
        check_token_ids("ids", ids, dim=2, nonempty=True)
        check_id_range("ids", ids, self.config.vocab_size)
        maps = []
        with eval_mode(self):
            x = self.embed(ids)
            for block in self.blocks:
                maps.append(attention_weights(block.attn, block.norm1(x)))
                x = block(x)
        return maps

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 use_cache: bool = True, generator: torch.Generator | None = None,
                 min_p: float | None = None,
                 repetition_penalty: float | None = None) -> torch.Tensor:
        """Extend ``ids`` ``(B, T)`` by ``max_new_tokens`` tokens:
        ``(B, T + max_new_tokens)``.

        Each step samples from the last position's logits with
        :func:`lib.sampling.sample_next`, in this order: ``repetition_penalty`` (over
        every token of the sequence so far, prompt included; None or 1.0 = off),
        ``temperature`` (0 = greedy), then the filters ``top_k``, ``top_p``, ``min_p``
        (None = off), then the draw. With ``use_cache`` the first step processes the
        prompt and later steps only the newest token, reading earlier keys and values
        from a KV cache. The model sees at most ``context_length`` tokens: once the
        sequence is longer, every step recomputes on the last ``context_length`` tokens
        (as without a cache). Runs in eval mode.
        """
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
                if caches is None:
                    context = ids[:, -ctx:]  # (B, <= ctx)
                else:  # the tokens the cache has not seen yet
                    context = ids[:, caches[0].length:]
                logits, _ = self(context, kv_caches=caches)  # (B, T', V)
                next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p,
                                      generator, min_p=min_p, previous_ids=ids,
                                      repetition_penalty=repetition_penalty)  # (B,)
                next_id = next_id[:, None].to(ids.dtype)  # (B, 1)
                ids = torch.cat([ids, next_id], dim=1)  # (B, T + 1)
        return ids

    def set_fused(self, enabled: bool) -> None:
        """The one switch for every fused-kernel path: attention
        (``F.scaled_dot_product_attention``), norms, GELU and the loss
        (``F.cross_entropy``). ``False`` runs the written-out math everywhere; the
        results agree to rounding."""
        for module in self.modules():  # self included: the loss is chosen by self.fused
            if hasattr(module, "fused"):
                module.fused = bool(enabled)

    def num_parameters(self) -> int:
        """Number of trainable parameters; a tied embedding/head matrix counts once."""
        return sum(p.numel() for p in self.parameters())

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by component: embeddings, positions, attention, ffn, norms, head.

        ``head`` is 0 when the head is tied to the token embeddings (it is the same
        matrix). The values sum to :meth:`num_parameters`.
        """
        parts = ("embeddings", "positions", "attention", "ffn", "norms", "head")
        counts = dict.fromkeys(parts, 0)
        for name, p in self.named_parameters():  # a tied matrix counts once, as tok_emb
            if name.startswith("tok_emb."):
                part = "embeddings"
            elif name.startswith("pos_emb."):
                part = "positions"
            elif ".attn." in name:
                part = "attention"
            elif ".ffn." in name:
                part = "ffn"
            elif name.startswith("norm_f.") or ".norm1." in name or ".norm2." in name:
                part = "norms"
            elif name.startswith("lm_head."):
                part = "head"
            else:  # pragma: no cover - a new kind of parameter needs a component
                raise RuntimeError(f"parameter {name} belongs to no known component")
            counts[part] += p.numel()
        return counts
