"""The architecture of a GPT as one dataclass, :class:`GPTConfig`, with presets.

GPT-2-style and Llama-style models are the same code with different settings:
:meth:`GPTConfig.tiny` (the book's character model), :meth:`GPTConfig.gpt2_small`,
:meth:`GPTConfig.llama_style`. :mod:`lib.block` and :mod:`lib.model` build modules from it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from lib.checks import check_bool, check_choice, check_divisible, check_int, check_number

NORMS = ("layernorm", "rmsnorm")
FFNS = ("gelu", "gelu_tanh", "relu", "swiglu")
POSITIONS = ("learned", "sinusoidal", "rope", "none")


@dataclass
class GPTConfig:
    """Every architectural choice of a GPT. The defaults are the tiny character model.

    ``n_kv_heads``: the number of key/value heads as configured; None means one per query head
    (plain multi-head attention). The property :attr:`kv_heads` is the resolved number (never None)
    that the code uses.
    ``ffn`` names the feed-forward network by its non-linearity. Three are the two-matrix MLP
    (``lib.feedforward.FeedForward``) with a different activation: 'gelu' (exact), 'gelu_tanh'
    (GPT-2's approximation), 'relu'. The fourth, 'swiglu', is a different architecture: the gated
    three-matrix network of Llama (``lib.feedforward.SwiGLU``).
    ``positions``: 'learned' (GPT-2), 'sinusoidal', 'rope' (Llama) or 'none'.
    ``window``: sliding-window attention span (None = attend to the whole past).
    """

    vocab_size: int = 65
    context_length: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int = 512
    norm: str = "layernorm"
    ffn: str = "gelu"
    positions: str = "learned"
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    dropout: float = 0.0
    bias: bool = False
    window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            check_int(name, getattr(self, name))
        check_int("n_kv_heads", self.n_kv_heads, optional=True)
        check_int("window", self.window, optional=True)
        check_divisible("d_model", self.d_model, "n_heads", self.n_heads)
        check_divisible("n_heads", self.n_heads, "n_kv_heads", self.kv_heads)
        check_choice("norm", self.norm, NORMS)
        check_choice("ffn", self.ffn, FFNS)
        check_choice("positions", self.positions, POSITIONS)
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"positions='rope' needs an even head dimension, but d_model / n_heads = "
                             f"{self.d_model} / {self.n_heads} = {self.head_dim}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"positions='sinusoidal' needs an even d_model, got {self.d_model}")
        check_number("rope_base", self.rope_base, low=1, low_open=True)
        check_number("dropout", self.dropout, 0, 1, high_open=True)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_bool("bias", self.bias)

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head, ``d_model / n_heads``."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """The resolved number of key/value heads: ``n_kv_heads``, or ``n_heads`` when that is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-friendly), the inverse of :meth:`from_dict`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Rebuild a config from :meth:`to_dict`'s output; unknown keys are an error."""
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def tiny(cls, vocab_size: int = 65, **overrides: Any) -> GPTConfig:
        """A small character-level model that trains in minutes on a laptop CPU (about 0.8M parameters)."""
        config = cls(vocab_size=vocab_size, context_length=128, d_model=128, n_layers=4, n_heads=4,
                     d_ff=512, norm="layernorm", ffn="gelu", positions="learned", tie_embeddings=True,
                     dropout=0.0, bias=False)
        return replace(config, **overrides)

    @classmethod
    def gpt2_small(cls, **overrides: Any) -> GPTConfig:
        """GPT-2 small (124M): LayerNorm with biases, tanh-GELU MLP, learned positions, tied head."""
        config = cls(vocab_size=50257, context_length=1024, d_model=768, n_layers=12, n_heads=12,
                     d_ff=3072, norm="layernorm", ffn="gelu_tanh", positions="learned",
                     tie_embeddings=True, dropout=0.0, bias=True)
        return replace(config, **overrides)

    @classmethod
    def llama_style(cls, **overrides: Any) -> GPTConfig:
        """Shaped like Llama 3.2 1B: RMSNorm, SwiGLU, RoPE (base 500,000), 8 key/value heads, no biases."""
        config = cls(vocab_size=128256, context_length=131072, d_model=2048, n_layers=16, n_heads=32,
                     n_kv_heads=8, d_ff=8192, norm="rmsnorm", ffn="swiglu", positions="rope",
                     rope_base=500000.0, tie_embeddings=True, dropout=0.0, bias=False)
        return replace(config, **overrides)
