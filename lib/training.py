"""The training loop every chapter uses: AdamW, warmup + cosine schedule, clipping, evaluation, checkpoints.

One call trains any ``nn.Module`` whose ``forward(x, y)`` returns ``(logits, loss)``::

    history = train(model, train_ids, val_ids, TrainConfig(max_steps=500, batch_size=32,
                                                           context_length=64), progress=False)
    history.val_loss  # one value per evaluation, at the steps in history.step

What the loop does, step by step:

* samples a batch with :func:`lib.data.get_batch` from a ``torch.Generator`` seeded with
  ``config.seed`` (so the batches depend on the seed only, whatever the device),
* sets the learning rate from :func:`lr_at` (linear warmup, then cosine decay to ``min_lr``),
* runs forward and backward (under bf16 autocast on CUDA), clips the gradient norm, takes an AdamW
  step (weight decay on matrices only, see :func:`configure_optimizer`),
* every ``eval_interval`` steps measures the mean loss on fixed train and validation batches,
  records it in the :class:`History`, and writes a checkpoint when ``checkpoint_path`` is given.

Checkpoints are one safetensors file: the tensors (weights, optimizer moments, random-generator
states) plus a JSON header (model and training configs, step, history). They are written to a
temporary file and renamed into place, so a crash never leaves half a checkpoint. Resuming restores
everything the next step depends on, so on CPU a resumed run produces the same losses, bit for bit,
as one that was never interrupted.

Progress bars: ``progress=True`` shows a ``tqdm.auto`` bar. Notebooks checked by nbval either pass
``progress=False`` or put the call in a cell marked ``# NBVAL_IGNORE_OUTPUT``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from lib.data import get_batch

__all__ = [
    "TrainConfig", "History", "Checkpoint", "lr_at", "configure_optimizer", "evaluate", "train",
    "save_checkpoint", "load_checkpoint",
]

_DEVICES = ("cpu", "cuda", "mps")
_FORMAT = "gptbook-checkpoint-1"
# Fields of TrainConfig that change where or how fast a run computes, not what it computes; a run may
# resume with different values for these.
_RESUMABLE_FIELDS = ("device", "compile")


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
    on CUDA (ignored elsewhere). ``compile`` wraps the model in ``torch.compile`` on CUDA (ignored on
    CPU and MPS, where compiling costs more than it saves at the book's sizes).
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

    def __post_init__(self) -> None:
        def positive_int(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

        def number(name: str, minimum: float, allow_equal: bool = True) -> None:
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < minimum or (value == minimum and not allow_equal):
                relation = ">=" if allow_equal else ">"
                raise ValueError(f"{name} must be a finite number {relation} {minimum}, got {value!r}")

        for name in ("max_steps", "batch_size", "context_length", "eval_interval", "eval_batches"):
            positive_int(name)
        positive_int("warmup_steps", 0)
        positive_int("seed", 0)
        number("lr", 0.0, allow_equal=False)
        number("min_lr", 0.0)
        number("weight_decay", 0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be <= lr, got min_lr={self.min_lr!r} and lr={self.lr!r}")
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps must be <= max_steps, got warmup_steps={self.warmup_steps} "
                             f"and max_steps={self.max_steps}")
        if self.grad_clip is not None:
            number("grad_clip", 0.0, allow_equal=False)
        betas = self.betas
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if self.device is not None and _device_type(self.device) not in _DEVICES:
            raise ValueError(f"device must be None or one of {_DEVICES} (optionally with an index, "
                             f"e.g. 'cuda:0'), got {self.device!r}")
        for name in ("amp", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

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


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate for optimisation step ``step`` (0-based): linear warmup, then cosine decay.

    Warmup rises linearly from ``lr / warmup_steps`` (step 0) to ``lr`` (step ``warmup_steps - 1``);
    then the rate follows half a cosine from ``lr`` down to ``min_lr``, reached at ``max_steps`` and
    held after it.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = config.max_steps - config.warmup_steps
    progress = 1.0 if decay_steps == 0 else min(1.0, (step - config.warmup_steps) / decay_steps)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def configure_optimizer(model: nn.Module, lr: float, weight_decay: float,
                        betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices (weights, embeddings) only.

    Parameters with two or more dimensions decay; vectors (biases, norm gains) do not: shrinking a
    norm's gain or a bias toward zero is not the regularisation we want. Frozen parameters are left
    out. A parameter shared by two modules (tied embeddings) appears once.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                or value < 0 or (name != "weight_decay" and value == 0):
            raise ValueError(f"{name} must be a finite number {'>=' if name == 'weight_decay' else '>'} 0, "
                             f"got {value!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.device.type == "cuda" for p in params)  # one kernel per step on CUDA
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _autocast(device: torch.device, amp: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when ``amp`` is set; a no-op context elsewhere."""
    if amp and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _check_ids(name: str, data: Any, context_length: int, vocab_size: int | None) -> None:
    if not isinstance(data, torch.Tensor) or data.dim() != 1 or data.dtype.is_floating_point \
            or data.dtype == torch.bool or data.is_complex():
        raise ValueError(f"{name} must be a 1-D integer tensor of token ids, got "
                         f"{getattr(data, 'dtype', type(data).__name__)} {tuple(getattr(data, 'shape', ()))}")
    if len(data) < context_length + 1:
        raise ValueError(f"{name} has {len(data)} tokens; context_length={context_length} needs at least "
                         f"{context_length + 1}")
    if vocab_size is not None and (int(data.min()) < 0 or int(data.max()) >= vocab_size):
        raise ValueError(f"{name} holds ids outside [0, {vocab_size}) (the model's vocab_size): "
                         f"min {int(data.min())}, max {int(data.max())}")


def _model_config_dict(model: nn.Module) -> dict[str, Any] | None:
    """The model's ``config`` (a dataclass, as on ``lib.model.GPT``) as JSON data, or None."""
    config = getattr(model, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return None
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _loss_of(output: Any) -> torch.Tensor:
    """The loss from a model's ``(logits, loss)`` output, or a TypeError saying what was expected."""
    if not (isinstance(output, (tuple, list)) and len(output) == 2 and isinstance(output[1], torch.Tensor)
            and output[1].dim() == 0):
        raise TypeError("model(x, y) must return (logits, loss) with a scalar loss tensor, got "
                        f"{type(output).__name__}")
    return output[1]


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, batch_size: int, context_length: int,
             n_batches: int = 10, seed: int = 0, amp: bool = True) -> float:
    """Mean loss of ``model`` over ``n_batches`` random batches of ``data`` (in eval mode, no grad).

    The batches come from a generator seeded with ``seed``, so repeated evaluations see the same
    windows and their differences reflect the model, not the sampling.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("batch_size", batch_size), ("context_length", context_length),
                        ("n_batches", n_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    _check_ids("data", data, context_length, None)
    device = _model_device(model)
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), device=device)
        for _ in range(n_batches):
            x, y = get_batch(data, batch_size, context_length, generator=generator, device=device)
            with _autocast(device, amp):
                loss = _loss_of(model(x, y))
            total += loss.float()
        return float(total) / n_batches
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------------------
# Checkpoints


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read besides the weights it loaded into the model."""

    step: int
    model_config: dict[str, Any] | None
    train_config: TrainConfig | None
    history: History | None
    extra: dict[str, Any]
    rng: dict[str, torch.Tensor]


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                         optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = value
    for index, slots in meta["scalars"].items():
        state.setdefault(int(index), {}).update(slots)
    groups = []
    for saved, current in zip(meta["param_groups"], optimizer.param_groups):
        group = dict(saved)
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        # Keep this machine's implementation choices (a CUDA checkpoint may say fused=True).
        for key in ("foreach", "fused", "capturable", "differentiable"):
            if key in current:
                group[key] = current[key]
        groups.append(group)
    return {"state": state, "param_groups": groups}


def _check_checkpoint_args(path: Any, model: Any, optimizer: Any) -> None:
    """The argument checks that saving and loading share."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    step: int = 0, train_config: TrainConfig | None = None, history: History | None = None,
                    rng: dict[str, torch.Tensor] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (and optionally the optimizer and run state) to one safetensors file, atomically.

    Tensors go in the file body under ``model/…``, ``optim/…`` and ``rng/…``; configs, step, history
    and ``extra`` (any JSON data) go in its header. The file is written next to ``path`` under a
    temporary name and renamed over ``path``, so readers only ever see a complete checkpoint.
    """
    from safetensors.torch import save_file

    _check_checkpoint_args(path, model, optimizer)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if train_config is not None and not isinstance(train_config, TrainConfig):
        raise TypeError(f"train_config must be a TrainConfig or None, got {type(train_config).__name__}")
    if history is not None and not isinstance(history, History):
        raise TypeError(f"history must be a History or None, got {type(history).__name__}")
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except TypeError as exc:
        raise ValueError(f"extra must be JSON-serialisable data: {exc}") from None

    named = {f"model/{k}": v for k, v in model.state_dict().items()}
    optim_meta = None
    if optimizer is not None:
        optim_tensors, optim_meta = _flatten_optimizer(optimizer)
        named.update(optim_tensors)
    named.update({f"rng/{k}": v for k, v in (rng or {}).items()})

    # Tied weights are one tensor under two names: store it once and remember the alias.
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in named.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype, tensor.device)
        if tensor.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        pointer = tensor.untyped_storage().data_ptr()
        tensor = tensor.to("cpu").contiguous()
        if pointer in storages or tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone()  # a partial view of a stored tensor: safetensors wants its own copy
        storages.update({pointer, tensor.untyped_storage().data_ptr()})
        tensors[name] = tensor

    header = {
        "format": _FORMAT,
        "step": step,
        "model_class": type(model).__name__,
        "model_config": _model_config_dict(model),
        "train_config": None if train_config is None else train_config.to_dict(),
        "history": None if history is None else history.as_dict(),
        "optimizer": optim_meta,
        "aliases": aliases,
        "extra": extra_json,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp_name, metadata={"format": "pt", "gptbook": json.dumps(header)})
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; a checkpoint is an ordinary file
        os.replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return path


def _config_mismatch(saved: dict[str, Any] | None, current: dict[str, Any] | None,
                     ignore: tuple[str, ...] = ()) -> list[str]:
    if saved is None or current is None:
        return []
    keys = sorted((set(saved) | set(current)) - set(ignore))
    return [f"{k}: checkpoint {saved.get(k, '<missing>')!r}, given {current.get(k, '<missing>')!r}"
            for k in keys if saved.get(k, "<missing>") != current.get(k, "<missing>")]


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    The model's ``config`` (when it has a dataclass config, as ``lib.model.GPT`` does) must equal
    the saved one, and the saved tensors must match the model's names and shapes; otherwise a
    ValueError lists what differs. Returns the rest of the run state as a :class:`Checkpoint`.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    _check_checkpoint_args(path, model, optimizer)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path {str(path)!r} is not a checkpoint file (it does not exist)")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {})["gptbook"])
        tensors = load_file(str(path), device="cpu")
    except Exception as exc:  # noqa: BLE001 - any parse failure means "not our checkpoint"
        raise ValueError(f"path {str(path)!r} is not a readable checkpoint written by save_checkpoint: "
                         f"{exc}") from None
    if header.get("format") != _FORMAT:
        raise ValueError(f"path {str(path)!r} has format {header.get('format')!r}, expected {_FORMAT!r}")
    for name, target in header["aliases"].items():
        tensors[name] = tensors[target]

    mismatch = _config_mismatch(header["model_config"], _model_config_dict(model))
    if mismatch:
        raise ValueError("the checkpoint's model config does not match model: " + "; ".join(mismatch))
    weights = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    expected = model.state_dict()
    problems = [f"missing {k}" for k in expected if k not in weights]
    problems += [f"unexpected {k}" for k in weights if k not in expected]
    problems += [f"{k}: checkpoint shape {tuple(weights[k].shape)}, model shape {tuple(v.shape)}"
                 for k, v in expected.items() if k in weights and weights[k].shape != v.shape]
    if problems:
        raise ValueError(f"the checkpoint's tensors do not fit model ({header['model_class']} saved): "
                         + "; ".join(problems[:10]) + (" …" if len(problems) > 10 else ""))
    model.load_state_dict(weights)
    if optimizer is not None:
        if header["optimizer"] is None:
            raise ValueError(f"optimizer was given but path {str(path)!r} holds no optimizer state")
        if len(header["optimizer"]["param_groups"]) != len(optimizer.param_groups):
            raise ValueError("optimizer has a different number of parameter groups than the checkpoint's")
        optimizer.load_state_dict(_unflatten_optimizer(tensors, header["optimizer"], optimizer))
    return Checkpoint(
        step=header["step"],
        model_config=header["model_config"],
        train_config=None if header["train_config"] is None else TrainConfig.from_dict(header["train_config"]),
        history=None if header["history"] is None else History.from_dict(header["history"]),
        extra=header["extra"],
        rng={k[len("rng/"):]: v for k, v in tensors.items() if k.startswith("rng/")},
    )


# ----------------------------------------------------------------------------------------------
# The loop


def _rng_state(generator: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """Every random state the next step depends on: the batch sampler and torch's global RNGs."""
    state = {"batches": generator.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rng(state: dict[str, torch.Tensor], generator: torch.Generator, device: torch.device) -> None:
    generator.set_state(state["batches"])
    torch.set_rng_state(state["torch"])  # dropout draws from the global generator
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _split(losses: list[torch.Tensor]) -> Iterator[float]:
    """Move a list of 0-d device tensors to Python floats with a single synchronisation."""
    if losses:
        yield from torch.stack(losses).float().cpu().tolist()


def train(model: nn.Module, train_data: torch.Tensor, val_data: torch.Tensor | None, config: TrainConfig,
          checkpoint_path: str | os.PathLike | None = None, resume: bool = False, progress: bool = True,
          stop_at: int | None = None) -> History:
    """Train ``model`` on token ids ``train_data`` and return its :class:`History`.

    ``val_data`` (or None) is evaluated alongside the training data every ``config.eval_interval``
    steps, at step 0 and at the last step. With ``checkpoint_path``, a checkpoint is written after
    every evaluation and when the run stops; ``resume=True`` continues from it (the history then
    covers the whole run). ``stop_at`` ends this session after that many steps while keeping the
    schedule of ``config.max_steps``, so a long run can be split into sessions.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    model_config = getattr(model, "config", None)
    vocab_size = getattr(model_config, "vocab_size", None)
    max_context = getattr(model_config, "context_length", None)
    if isinstance(max_context, int) and config.context_length > max_context:
        raise ValueError(f"config.context_length={config.context_length} exceeds the model's "
                         f"context_length={max_context}")
    _check_ids("train_data", train_data, config.context_length, vocab_size)
    if val_data is not None:
        _check_ids("val_data", val_data, config.context_length, vocab_size)
    if checkpoint_path is not None and not isinstance(checkpoint_path, (str, os.PathLike)):
        raise TypeError("checkpoint_path must be a str, os.PathLike or None, got "
                        f"{type(checkpoint_path).__name__}")
    if not isinstance(resume, bool):
        raise ValueError(f"resume must be True or False, got {resume!r}")
    if resume and checkpoint_path is None:
        raise ValueError("resume=True needs a checkpoint_path to resume from")
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True or False, got {progress!r}")
    if stop_at is not None and (not isinstance(stop_at, int) or isinstance(stop_at, bool)
                                or not 1 <= stop_at <= config.max_steps):
        raise ValueError(f"stop_at must be None or an int in [1, max_steps={config.max_steps}], got {stop_at!r}")

    if config.device is not None:
        model.to(config.device)
    device = _model_device(model)
    optimizer = configure_optimizer(model, config.lr, config.weight_decay, config.betas)
    generator = torch.Generator().manual_seed(config.seed)
    history = History()
    start = 0
    if resume:
        checkpoint = load_checkpoint(checkpoint_path, model, optimizer)
        if checkpoint.train_config is None or checkpoint.history is None or "batches" not in checkpoint.rng:
            raise ValueError(f"checkpoint_path {str(checkpoint_path)!r} was not written by train(); "
                             "it has no training state to resume")
        mismatch = _config_mismatch(checkpoint.train_config.to_dict(), config.to_dict(), _RESUMABLE_FIELDS)
        if mismatch:
            raise ValueError("config does not match the checkpoint's training config (a resumed run must "
                             "use the same settings): " + "; ".join(mismatch))
        start, history = checkpoint.step, checkpoint.history
        _restore_rng(checkpoint.rng, generator, device)
    end = stop_at if stop_at is not None else config.max_steps
    if start > end:
        raise ValueError(f"stop_at={stop_at} is before the checkpoint's step {start}")

    forward = torch.compile(model) if config.compile and device.type == "cuda" else model
    params = [p for p in model.parameters() if p.requires_grad]
    clip = config.grad_clip if config.grad_clip is not None else float("inf")
    pending_loss: list[torch.Tensor] = []
    pending_norm: list[torch.Tensor] = []

    def flush() -> None:
        history.batch_loss.extend(_split(pending_loss))
        history.grad_norm.extend(_split(pending_norm))
        pending_loss.clear()
        pending_norm.clear()
        if history.batch_loss and not math.isfinite(history.batch_loss[-1]):
            raise FloatingPointError(f"the training loss became {history.batch_loss[-1]} by step "
                                     f"{len(history.batch_loss)}; try a lower config.lr or grad_clip")

    def record(step: int) -> None:
        flush()
        kwargs = dict(batch_size=config.batch_size, context_length=config.context_length,
                      n_batches=config.eval_batches, amp=config.amp)
        history.step.append(step)
        history.train_loss.append(evaluate(model, train_data, seed=config.seed + 1, **kwargs))
        history.val_loss.append(float("nan") if val_data is None
                                else evaluate(model, val_data, seed=config.seed + 2, **kwargs))
        history.lr.append(lr_at(step, config))
        bar.set_postfix(train=f"{history.train_loss[-1]:.3f}", val=f"{history.val_loss[-1]:.3f}")

    def save(step: int) -> None:
        if checkpoint_path is not None:
            save_checkpoint(checkpoint_path, model, optimizer, step=step, train_config=config,
                            history=history, rng=_rng_state(generator, device))

    with warnings.catch_warnings():
        # In a Jupyter kernel without ipywidgets, tqdm.auto warns (on stderr) and falls back to a text
        # bar; the warning would differ between a run that trains and one that loads a cached model.
        warnings.filterwarnings("ignore", message="IProgress not found")
        from tqdm.auto import tqdm

    bar = tqdm(total=config.max_steps, initial=start, disable=not progress, desc="training", unit="step")
    model.train()
    try:
        if not history.step:  # a fresh run: measure the untrained model first
            record(0)
            save(0)
        for step in range(start, end):
            lr = lr_at(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = get_batch(train_data, config.batch_size, config.context_length, generator=generator,
                             device=device)  # (B, T) each
            with _autocast(device, config.amp):
                loss = _loss_of(forward(x, y))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending_loss.append(loss.detach())
            pending_norm.append(norm.detach())
            bar.update(1)
            done = step + 1
            if done % config.eval_interval == 0 or done == config.max_steps:
                record(done)
                save(done)
        flush()
        if end > start and (history.step[-1] != end):
            save(end)  # stopped between evaluations: keep the state for resume
    finally:
        bar.close()
    return history
