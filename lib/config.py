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
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lib.checks import check_bool, check_choice, check_divisible, check_int, check_number
from lib.cpu_kernels import BMM_MAX_POSITIONS
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
    """All that decides what a GPT computes (``GPT(config)`` builds exactly this); the defaults
    are the tiny model.

    ``n_kv_heads``: key/value heads (None = ``n_heads``). ``ffn``: 'gelu', 'gelu_tanh' (GPT-2)
    or 'relu' name the two-matrix MLP's activation; 'swiglu' is Llama's gated network; 'moe' a
    mixture of ``n_experts`` SwiGLU experts, ``moe_top_k`` per token, whose load-balancing loss
    times ``moe_aux_weight`` (None = 0.01) joins the training gradient (the three fields are read
    only with ``ffn='moe'``). ``positions``: 'learned', 'sinusoidal', 'rope' or 'none';
    ``rope_scaling``: None or a rule of ``lib.positional.check_rope_scaling``. ``qk_norm``:
    RMSNorm on each head's queries and keys. ``window``: sliding-window span (None = the whole
    past), plus ``sinks`` first positions always seen. ``norm_eps``: None = 1e-5 (LayerNorm),
    1e-6 (RMSNorm). ``cpu_kernels``: attention through ``lib.cpu_kernels`` (CPU; no window).
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
    sinks: int = 0
    cpu_kernels: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            check_int(name, getattr(self, name))
        for name in ("n_kv_heads", "window"):
            check_int(name, getattr(self, name), optional=True)
        check_divisible("d_model", self.d_model, "n_heads", self.n_heads)
        check_divisible("n_heads", self.n_heads, "n_kv_heads", self.n_kv_heads or self.n_heads)
        for name, allowed in (("norm", NORMS), ("ffn", FFNS), ("positions", POSITIONS)):
            check_choice(name, getattr(self, name), allowed)
        if self.positions == "rope" and self.head_dim % 2:  # dimensions rotate in pairs
            raise ValueError(f"positions='rope' needs an even head dimension, got {self.head_dim}")
        if self.positions == "sinusoidal" and self.d_model % 2:  # (sin, cos) pairs
            raise ValueError(f"positions='sinusoidal' needs an even d_model, got {self.d_model}")
        check_number("rope_base", self.rope_base, low=1, low_open=True)
        check_number("dropout", self.dropout, 0, 1, high_open=True)
        check_number("norm_eps", self.norm_eps, low=0, low_open=True, optional=True)
        for name in ("tie_embeddings", "bias", "qk_norm", "cpu_kernels"):
            check_bool(name, getattr(self, name))
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        check_int("sinks", self.sinks, minimum=0)
        if self.rope_scaling is not None and self.positions != "rope":
            raise ValueError(f"rope_scaling needs positions='rope', got {self.positions!r}")
        if self.sinks and self.window is None:
            raise ValueError(f"sinks={self.sinks} needs a window")
        if self.cpu_kernels and (self.window or self.context_length > BMM_MAX_POSITIONS):
            raise ValueError(f"cpu_kernels=True needs window=None and context_length <= {BMM_MAX_POSITIONS}"
                             f", got window={self.window}, context_length={self.context_length}")
        if self.ffn == "moe":
            check_int("n_experts", self.n_experts, minimum=2)
            check_int("moe_top_k", self.moe_top_k, minimum=1, maximum=self.n_experts)
            check_number("moe_aux_weight", self.moe_aux_weight, low=0, optional=True)

    @property
    def aux_weight(self) -> float:
        """The weight of the MoE load-balancing loss (0.01 by default, 0.0 without experts)."""
        if self.ffn != "moe":
            return 0.0
        return 0.01 if self.moe_aux_weight is None else float(self.moe_aux_weight)

    @property
    def head_dim(self) -> int:  # the dimension of one attention head
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-friendly), the inverse of :meth:`from_dict`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Rebuild a config from :meth:`to_dict`'s output."""
        return cls(**d)  # an unknown key is a TypeError naming it

    @classmethod
    def tiny(cls, vocab_size: int = 65, **overrides: Any) -> GPTConfig:
        """The defaults: a character-level model (0.8M parameters) that trains in minutes."""
        return cls(vocab_size=vocab_size, **overrides)

    @classmethod
    def gpt2_small(cls, **overrides: Any) -> GPTConfig:
        """GPT-2 small (124M): LayerNorm with biases, tanh-GELU MLP, learned positions, tied head."""
        return cls(**{**dict(vocab_size=50257, context_length=1024, d_model=768, n_layers=12,
                             n_heads=12, d_ff=3072, ffn="gelu_tanh", bias=True), **overrides})

    @classmethod
    def llama_style(cls, **overrides: Any) -> GPTConfig:
        """Shaped like Llama 3.2 1B: RMSNorm, SwiGLU, 8 key/value heads, RoPE (base 500,000) with
        Llama 3's scaling (:data:`LLAMA3_ROPE_SCALING`: pre-trained at 8,192, used at 131,072)."""
        return cls(**{**dict(vocab_size=128256, context_length=131072, d_model=2048, n_layers=16,
                             n_heads=32, n_kv_heads=8, d_ff=8192, norm="rmsnorm", ffn="swiglu",
                             positions="rope", rope_base=500000.0,
                             rope_scaling=dict(LLAMA3_ROPE_SCALING)), **overrides})


_DEVICES = ("cpu", "cuda", "mps")


def device_type(device: Any) -> str | None:
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
        for name in ("warmup_steps", "seed"):
            check_int(name, getattr(self, name), minimum=0)
        for name in ("lr", "min_lr", "weight_decay"):
            check_number(name, getattr(self, name), low=0, low_open=name == "lr")
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
        if self.device is not None and device_type(self.device) not in _DEVICES:
            raise ValueError(f"device must be None or one of {_DEVICES} (optionally with an index, "
                             f"e.g. 'cuda:0'), got {self.device!r}")
        for name in ("amp", "compile"):
            check_bool(name, getattr(self, name))
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
