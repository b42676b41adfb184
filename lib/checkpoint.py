"""Checkpoints: one safetensors file holding everything a training run needs to continue.

The tensors (weights, optimizer moments, random-generator states) go in the file body under
``model/…``, ``optim/…`` and ``rng/…``; the model and training configs, the step, the history and
any extra JSON data go in its header. The model config is every field of the ``GPTConfig`` that
built the model, so ``GPT(GPTConfig.from_dict(checkpoint.model_config))`` builds what ran; loading
fills the model with :func:`lib.pretrained.fill`, the loader Hugging Face and GGUF files use.
Files are written to a temporary name and renamed into place, so a crash never leaves half a
checkpoint. :func:`resume_training` restores everything the next training step depends on, so on
CPU a resumed run produces the same losses, bit for bit, as one that was never interrupted.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lib.checks import check_int, check_type
from lib.config import History, TrainConfig
from lib.pretrained import fill

__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint", "resume_training", "rng_state",
           "best_checkpoint_path"]

_FORMAT = "gptbook-checkpoint-1"
# Fields of TrainConfig that change where or how fast a run computes, not what it computes (the fused
# AdamW kernel only rounds differently); a run may resume with different values for these.
_RESUMABLE_FIELDS = ("device", "compile", "fused_adamw")
# The GPTConfig field that changes how attention is computed on a CPU, not what (the same
# parameters, the same results up to rounding); a checkpoint loads with either value.
_LOADABLE_FIELDS = ("cpu_kernels",)


def best_checkpoint_path(path: str | os.PathLike) -> Path:
    """Where :func:`lib.training.train` keeps the checkpoint of the lowest validation loss so far,
    next to its latest one at ``path``: ``run.safetensors`` -> ``run.best.safetensors``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.best{path.suffix}")


def _config_dict(config: Any) -> dict[str, Any] | None:
    """A dataclass config (``GPTConfig``) as JSON data, or None."""
    if config is None or not dataclasses.is_dataclass(config):
        return None
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read besides the weights it loaded into the model.
    ``model_config`` is the saved model config as a dict (``GPTConfig.from_dict`` rebuilds
    it), with the defaults of fields added to the config class after the file was written."""

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
    check_type("path", path, (str, os.PathLike), "str or os.PathLike")
    check_type("model", model, nn.Module, "torch.nn.Module")
    check_type("optimizer", optimizer, torch.optim.Optimizer, "torch.optim.Optimizer", optional=True)


def _store_once(named: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to write, each on the CPU with storage of its own, and the aliases: a tied
    weight is one tensor under two names, stored under the first and remembered for the second."""
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
    return tensors, aliases


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> Path:
    """Write a safetensors file next to ``path`` under a temporary name and rename it over ``path``,
    so readers only ever see a complete checkpoint."""
    from safetensors.torch import save_file

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


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    step: int = 0, train_config: TrainConfig | None = None, history: History | None = None,
                    rng: dict[str, torch.Tensor] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (and optionally the optimizer and run state) to one safetensors file, atomically.

    Tensors go in the file body under ``model/…``, ``optim/…`` and ``rng/…``; the model's config
    (every field of a ``GPTConfig``), the training config, step, history and ``extra`` (any JSON
    data) go in its header.
    """
    _check_checkpoint_args(path, model, optimizer)
    check_int("step", step, minimum=0)
    named = {f"model/{k}": v for k, v in model.state_dict().items()}
    optim_tensors, optim_meta = _flatten_optimizer(optimizer) if optimizer is not None else ({}, None)
    named.update(optim_tensors)
    named.update({f"rng/{k}": v for k, v in (rng or {}).items()})
    tensors, aliases = _store_once(named)
    header = {
        "format": _FORMAT,
        "step": step,
        "model_class": type(model).__name__,
        "model_config": _config_dict(getattr(model, "config", None)),
        "train_config": None if train_config is None else train_config.to_dict(),
        "history": None if history is None else history.as_dict(),
        "optimizer": optim_meta,
        "aliases": aliases,
        "extra": json.loads(json.dumps(extra or {})),
    }
    return _write_atomically(Path(path), tensors, header)


def _config_mismatch(saved: dict[str, Any] | None, current: dict[str, Any] | None,
                     ignore: tuple[str, ...] = ()) -> list[str]:
    if saved is None or current is None:
        return []
    keys = sorted((set(saved) | set(current)) - set(ignore))
    return [f"{k}: checkpoint {saved.get(k, '<missing>')!r}, given {current.get(k, '<missing>')!r}"
            for k in keys if saved.get(k, "<missing>") != current.get(k, "<missing>")]


def _read(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and the tensors (aliases restored) of a file written by :func:`save_checkpoint`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"path {str(path)!r} is not a checkpoint file (it does not exist)")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {})["gptbook"])
        tensors = load_file(str(path), device="cpu")
    except Exception:  # noqa: BLE001 - any parse failure means "not our checkpoint"
        header = {}
    if header.get("format") != _FORMAT:
        raise ValueError(f"path {str(path)!r} is not a readable checkpoint written by save_checkpoint "
                         f"(format {_FORMAT!r})")
    for name, target in header["aliases"].items():
        tensors[name] = tensors[target]
    return header, tensors


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    The model's ``config`` (when it has a dataclass config, as ``lib.model.GPT`` does) must equal
    the saved one, ``cpu_kernels`` aside (a field the file lacks, being older than the field,
    counts as its default), and
    the saved tensors must fit the model (:func:`lib.pretrained.fill`); otherwise a ValueError lists
    what differs. Returns the rest of the run state as a :class:`Checkpoint`.
    """
    _check_checkpoint_args(path, model, optimizer)
    header, tensors = _read(Path(path))
    config = getattr(model, "config", None)
    saved = header["model_config"]
    if saved is not None and dataclasses.is_dataclass(config):  # older files lack newer fields
        defaults = {f.name: f.default for f in dataclasses.fields(config)
                    if f.default is not dataclasses.MISSING}
        saved = {**json.loads(json.dumps(defaults, default=str)), **saved}
    mismatch = _config_mismatch(saved, _config_dict(config), _LOADABLE_FIELDS)
    if mismatch:
        raise ValueError("the checkpoint's model config does not match model: " + "; ".join(mismatch))
    weights = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    fill(model, weights, "the checkpoint")
    if optimizer is not None:
        if header["optimizer"] is None:
            raise ValueError(f"optimizer was given but path {str(path)!r} holds no optimizer state")
        optimizer.load_state_dict(_unflatten_optimizer(tensors, header["optimizer"], optimizer))
    return Checkpoint(
        step=header["step"],
        model_config=saved,
        train_config=None if header["train_config"] is None else TrainConfig.from_dict(header["train_config"]),
        history=None if header["history"] is None else History.from_dict(header["history"]),
        extra=header["extra"],
        rng={k[len("rng/"):]: v for k, v in tensors.items() if k.startswith("rng/")},
    )


def rng_state(generator: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
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


def resume_training(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: TrainConfig, generator: torch.Generator,
                    device: torch.device) -> tuple[int, History]:
    """Load a checkpoint written by ``train`` into ``model``, ``optimizer`` and the batch
    ``generator``; return the step it reached and the history so far.

    The run must continue with the same training config (``device``, ``compile`` and ``fused_adamw`` aside);
    otherwise a ValueError lists the fields that differ.
    """
    checkpoint = load_checkpoint(path, model, optimizer)
    if checkpoint.train_config is None or checkpoint.history is None or "batches" not in checkpoint.rng:
        raise ValueError(f"checkpoint_path {str(path)!r} was not written by train(); "
                         "it has no training state to resume")
    mismatch = _config_mismatch(checkpoint.train_config.to_dict(), config.to_dict(), _RESUMABLE_FIELDS)
    if mismatch:
        raise ValueError("config does not match the checkpoint's training config (a resumed run must "
                         "use the same settings): " + "; ".join(mismatch))
    _restore_rng(checkpoint.rng, generator, device)
    return checkpoint.step, checkpoint.history
