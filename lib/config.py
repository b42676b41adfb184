"""The plain-data descriptions of a run: the model, the training settings, what training recorded.

- :class:`GPTConfig`: the architecture. GPT-2-style and Llama-style models are the same code with
  different settings: :meth:`GPTConfig.tiny` (the book's character model),
  :meth:`GPTConfig.gpt2_small`, :meth:`GPTConfig.llama_style`. :mod:`lib.block` and
  :mod:`lib.model` build modules from it.
- :class:`TrainConfig`: everything :func:`lib.training.train` needs besides the model and data.
- :class:`History`: the losses and learning rates a run recorded, ready to plot.

They live apart from the code that uses them so that the model, the training loop and the
checkpoint files can all read them without importing each other.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from lib.checks import check_bool, check_choice, check_divisible, check_int, check_number
from lib.positional import check_rope_scaling

NORMS = ("layernorm", "rmsnorm")
FFNS = ("gelu", "gelu_tanh", "relu", "swiglu", "moe")
POSITIONS = ("learned", "sinusoidal", "rope", "none")
# Llama 3.2's RoPE scaling (the "rope_scaling" of its config.json): pre-trained at 8,192 positions,
# slow frequencies divided by 32, served at 131,072 positions.
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
OPTIMIZERS = ("adamw", "muon")


@dataclass
class GPTConfig:
    """Every architectural choice of a GPT. The defaults are the tiny character model.

    ``n_kv_heads``: the number of key/value heads (grouped-query attention); None means one per
    query head, plain multi-head attention (the attention modules' ``n_kv_heads`` is then
    ``n_heads``).
    ``ffn`` names the feed-forward network by its non-linearity. Three are the two-matrix MLP
    (``lib.feedforward.FeedForward``) with a different activation: 'gelu' (exact), 'gelu_tanh'
    (GPT-2's approximation), 'relu'. The fourth, 'swiglu', is a different architecture: the gated
    three-matrix network of Llama (``lib.feedforward.SwiGLU``).
    The fifth, 'moe', is a mixture of experts (``lib.feedforward.MoE``): ``n_experts`` SwiGLU experts
    of width ``d_ff`` each, of which a router picks ``moe_top_k`` per token; during training
    :meth:`lib.model.GPT.forward` adds ``moe_aux_weight`` (None = 0.01; 0 switches balancing off)
    times the sum of the layers' load-balancing losses to the loss it returns. The three fields
    must be None unless ``ffn='moe'``.
    ``qk_norm``: RMSNorm on every head's queries and keys before the scores (and before RoPE).
    ``positions``: 'learned' (GPT-2), 'sinusoidal', 'rope' (Llama) or 'none'.
    ``window``: sliding-window attention span (None = attend to the whole past).
    ``norm_eps``: the epsilon of every norm layer (None = the layer's default: 1e-5 for LayerNorm,
    1e-6 for RMSNorm). ``rope_scaling``: None (plain RoPE) or a frequency-scaling rule for
    ``positions='rope'``, e.g. Llama 3's (``lib.positional.check_rope_scaling``).
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
    norm_eps: float | None = None
    rope_scaling: dict | None = None
    qk_norm: bool = False
    n_experts: int | None = None
    moe_top_k: int | None = None
    moe_aux_weight: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            check_int(name, getattr(self, name))
        check_int("n_kv_heads", self.n_kv_heads, optional=True)
        check_int("window", self.window, optional=True)
        check_divisible("d_model", self.d_model, "n_heads", self.n_heads)
        if self.n_kv_heads is not None:
            check_divisible("n_heads", self.n_heads, "n_kv_heads", self.n_kv_heads)
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
        check_number("norm_eps", self.norm_eps, low=0, low_open=True, optional=True)
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        if self.rope_scaling is not None and self.positions != "rope":
            raise ValueError(f"rope_scaling needs positions='rope', got positions={self.positions!r}")
        check_bool("qk_norm", self.qk_norm)
        if self.ffn == "moe":
            check_int("n_experts", self.n_experts, minimum=2)
            check_int("moe_top_k", self.moe_top_k, minimum=1, maximum=self.n_experts)
            check_number("moe_aux_weight", self.moe_aux_weight, low=0, optional=True)
        else:
            for name in ("n_experts", "moe_top_k", "moe_aux_weight"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs ffn='moe', got ffn={self.ffn!r} and "
                                     f"{name}={getattr(self, name)!r}")

    @property
    def aux_weight(self) -> float:
        """The resolved weight of the MoE load-balancing loss: ``moe_aux_weight``, 0.01 when that is
        None, and 0.0 for a model without experts."""
        if self.ffn != "moe":
            return 0.0
        return 0.01 if self.moe_aux_weight is None else float(self.moe_aux_weight)

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head, ``d_model / n_heads``."""
        return self.d_model // self.n_heads

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
        """Shaped like Llama 3.2 1B: RMSNorm, SwiGLU, RoPE (base 500,000) with Llama 3's frequency
        scaling (:data:`LLAMA3_ROPE_SCALING`, which is what makes the 131,072-token context work for
        a model pre-trained at 8,192), 8 key/value heads, no biases."""
        config = cls(vocab_size=128256, context_length=131072, d_model=2048, n_layers=16, n_heads=32,
                     n_kv_heads=8, d_ff=8192, norm="rmsnorm", ffn="swiglu", positions="rope",
                     rope_base=500000.0, tie_embeddings=True, dropout=0.0, bias=False,
                     rope_scaling=dict(LLAMA3_ROPE_SCALING))
        return replace(config, **overrides)


_DEVICES = ("cpu", "cuda", "mps")


def _device_type(device: Any) -> str | None:
    """'cpu', 'cuda', 'mps', … for a device string such as 'cuda:0'; None when it is not one."""
    try:
        return torch.device(device).type if isinstance(device, str) else None
    except RuntimeError:
        return None


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (together with the model and the data).

    ``device=None`` trains wherever the model's parameters already are. ``amp`` uses bf16 autocast
    on GPUs that run bf16 natively (CUDA compute capability >= 8: A100, H100, RTX 30xx on); older
    GPUs (a T4) train in float32, and CPUs and MPS ignore it. ``compile`` wraps the model in ``torch.compile`` on CUDA (ignored on
    CPU and MPS, where compiling costs more than it saves at the book's sizes). ``optimizer``:
    'adamw', or 'muon' (Muon for the hidden matrices, AdamW for the rest; see
    :func:`lib.training.configure_optimizer`). ``fused_adamw``: torch's one-kernel AdamW update;
    None = on CUDA only, True = on any device (the CPU profile sets it), False = never.
    """

    max_steps: int = 1000
    batch_size: int = 32
    context_length: int = 64
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0
    eval_interval: int = 100
    eval_batches: int = 10
    seed: int = 0
    device: str | None = None
    amp: bool = True
    compile: bool = False
    optimizer: str = "adamw"
    fused_adamw: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "context_length", "eval_interval", "eval_batches"):
            check_int(name, getattr(self, name))
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_int("seed", self.seed, minimum=0)
        check_number("lr", self.lr, low=0, low_open=True)
        check_number("min_lr", self.min_lr, low=0)
        check_number("weight_decay", self.weight_decay, low=0)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be <= lr, got min_lr={self.min_lr!r} and lr={self.lr!r}")
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps must be <= max_steps, got warmup_steps={self.warmup_steps} "
                             f"and max_steps={self.max_steps}")
        check_number("grad_clip", self.grad_clip, low=0, low_open=True, optional=True)
        betas = self.betas
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if self.device is not None and _device_type(self.device) not in _DEVICES:
            raise ValueError(f"device must be None or one of {_DEVICES} (optionally with an index, "
                             f"e.g. 'cuda:0'), got {self.device!r}")
        check_bool("amp", self.amp)
        check_bool("compile", self.compile)
        if self.fused_adamw is not None:
            check_bool("fused_adamw", self.fused_adamw)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-friendly data."""
        return {**dataclasses.asdict(self), "betas": list(self.betas)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """Rebuild a config from :meth:`to_dict` output; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"values has unknown TrainConfig fields {unknown}")
        return cls(**{k: tuple(v) if k == "betas" else v for k, v in values.items()})


@dataclass
class History:
    """What happened during training, as plain lists ready to plot.

    Evaluations: ``step[i]`` optimisation steps had been taken when ``train_loss[i]`` and
    ``val_loss[i]`` (mean loss over fixed batches; NaN without validation data) were measured, at
    learning rate ``lr[i]``. Per step: ``batch_loss[s]`` is the loss of the batch that step ``s + 1``
    trained on and ``grad_norm[s]`` its gradient norm before clipping.
    """

    step: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    batch_loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, list]:
        """The history as a dict of lists (e.g. for JSON or a DataFrame)."""
        return {f.name: list(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, list]) -> "History":
        """Rebuild a history from :meth:`as_dict` output."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, dict) or set(values) != names:
            raise ValueError(f"values must be a dict with exactly the keys {sorted(names)}")
        return cls(**{k: list(v) for k, v in values.items()})
