"""The transformer block: pre-norm attention, then a pre-norm feed-forward network, each
added to the residual stream.

    x = x + attn(norm1(x))    # tokens exchange information
    x = x + ffn(norm2(x))     # each token is processed on its own

Which norm, which feed-forward network and which positions are chosen by a
:class:`lib.config.GPTConfig`, so GPT-2-style and Llama-style blocks are the same code.
"""
from __future__ import annotations

import torch
from torch import nn

from lib.attention import KVCache, MultiHeadAttention
from lib.config import GPTConfig
from lib.cpu_kernels import CPUMultiHeadAttention
from lib.feedforward import MoE, FeedForward, SwiGLU
from lib.norms import LayerNorm, RMSNorm
from lib.positional import RotaryEmbedding

__all__ = ["TransformerBlock", "make_ffn", "make_norm"]


def make_norm(config: GPTConfig) -> nn.Module:
    """The normalisation layer the config asks for: LayerNorm (bias as ``config.bias``)
    or RMSNorm."""
    eps = {} if config.norm_eps is None else {"eps": config.norm_eps}  # None: default
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, **eps)
    return LayerNorm(config.d_model, bias=config.bias, **eps)  # the only other choice


def make_ffn(config: GPTConfig) -> nn.Module:
    """The feed-forward network the config asks for: SwiGLU for ``ffn='swiglu'``,
    otherwise the two-matrix MLP with ``config.ffn`` as its activation ('gelu',
    'gelu_tanh' or 'relu'), or a mixture of SwiGLU experts for ``ffn='moe'``."""
    if config.ffn == "moe":
        return MoE(config.d_model, config.d_ff, config.n_experts, config.moe_top_k,
                   bias=config.bias, dropout=config.dropout,
                   aux_weight=config.aux_weight)
    if config.ffn == "swiglu":
        return SwiGLU(config.d_model, config.d_ff, bias=config.bias,
                      dropout=config.dropout)
    return FeedForward(config.d_model, config.d_ff, activation=config.ffn,
                       bias=config.bias, dropout=config.dropout)


class TransformerBlock(nn.Module):
    """One pre-norm block: ``norm1``, ``attn``, ``norm2``, ``ffn``."""

    def __init__(self, config: GPTConfig, rope: RotaryEmbedding | None = None) -> None:
        """``rope``: the model's RotaryEmbedding, shared by all its blocks; given
        exactly when ``config.positions == 'rope'``."""
        super().__init__()
        if (rope is not None) != (config.positions == "rope"):
            raise ValueError(f"rope must be given exactly when config.positions == "
                             f"'rope'; got positions={config.positions!r}, "
                             f"rope={rope!r}")
        self.norm1 = make_norm(config)
        attention = CPUMultiHeadAttention if config.cpu_kernels else MultiHeadAttention
        self.attn = attention(config.d_model, config.n_heads, config.n_kv_heads,
                              rope=rope, bias=config.bias, dropout=config.dropout,
                              window=config.window, sinks=config.sinks,
                              qk_norm=config.qk_norm)
        self.norm2 = make_norm(config)
        self.ffn = make_ffn(config)

    def forward(self, x: torch.Tensor, offset: int = 0, kv_cache: KVCache | None = None,
                n_pad: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(B, T, C)`` at positions ``offset … offset+T-1`` -> same shape;
        ``n_pad`` ``(B,)``: each row's left padding, if any."""
        x = x + self.attn(self.norm1(x), offset, kv_cache, n_pad)  # tokens share info
        return x + self.ffn(self.norm2(x))  # each token processed on its own
