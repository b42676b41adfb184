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

Checkpoints (one safetensors file, written atomically, resumable bit for bit on CPU) are
:mod:`lib.checkpoint`; the configs and the :class:`History` are :mod:`lib.config`.

Progress bars: ``progress=True`` shows a ``tqdm.auto`` bar. Notebooks checked by nbval either pass
``progress=False`` or put the call in a cell tagged ``nbval-ignore-output``.

Data-parallel training: started by ``torchrun`` with ``torch.distributed`` initialised, ``train``
wraps the model in ``DistributedDataParallel``. Every process draws the same global batch of
``config.batch_size`` windows and trains on its own slice of it, so N processes compute the same
run as one process (to float rounding); only process 0 shows progress and writes checkpoints.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from lib.checkpoint import resume_training, rng_state, save_checkpoint
from lib.checks import check_bool, check_choice, check_id_range, check_int, check_number, check_token_ids, check_type
from lib.config import OPTIMIZERS, History, TrainConfig
from lib.optim import MuonAdamW
from lib.data import get_batch

# TrainConfig and History are re-exported: chapters import them from here, next to train.
__all__ = ["TrainConfig", "History", "lr_at", "configure_optimizer", "distributed_rank_and_size", "evaluate",
           "train"]


# torch's fused AdamW kernel runs on CPUs from torch 2.4 on.
_CPU_FUSED_ADAMW = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 4)


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate for optimisation step ``step`` (0-based): linear warmup, then cosine decay.

    Warmup rises linearly from ``lr / warmup_steps`` (step 0) to ``lr`` (step ``warmup_steps - 1``);
    then the rate follows half a cosine from ``lr`` down to ``min_lr``, reached at ``max_steps`` and
    held after it.
    """
    check_int("step", step, minimum=0)
    check_type("config", config, TrainConfig, "TrainConfig")
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = config.max_steps - config.warmup_steps
    progress = 1.0 if decay_steps == 0 else min(1.0, (step - config.warmup_steps) / decay_steps)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def configure_optimizer(model: nn.Module, lr: float, weight_decay: float,
                        betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                        optimizer: str = "adamw") -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices (weights, embeddings) only; torch's fused
    kernel on CUDA and on a CPU (torch >= 2.4; before that the multi-tensor kernel).

    Parameters with two or more dimensions decay; vectors (biases, norm gains) do not: shrinking a
    norm's gain or a bias toward zero is not the regularisation we want. Frozen parameters are left
    out. A parameter shared by two modules (tied embeddings) appears once.

    ``optimizer='muon'`` returns a :class:`lib.optim.MuonAdamW` instead: the weights of the
    ``nn.Linear`` layers (the hidden matrices) take Muon steps, except a module named ``lm_head``
    and any matrix shared with an ``nn.Embedding``; embeddings, the head, norm gains and biases take
    AdamW steps as above. Both use ``lr`` and ``weight_decay``.
    """
    check_type("model", model, nn.Module, "torch.nn.Module")
    check_number("lr", lr, low=0, low_open=True)
    check_number("weight_decay", weight_decay, low=0)
    check_number("eps", eps, low=0, low_open=True)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    if optimizer == "muon":
        embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        hidden = {id(m.weight) for name, m in model.named_modules()
                  if isinstance(m, nn.Linear) and name.split(".")[-1] != "lm_head"
                  and id(m.weight) not in embedded}
        muon = [p for p in params if id(p) in hidden]
        rest = [p for p in params if id(p) not in hidden]
        groups = [{"params": muon, "use_muon": True, "weight_decay": weight_decay},
                  {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
        return MuonAdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(betas), eps=eps)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kernel = {}
    if all(p.device.type == "cuda" for p in params) or (
            all(p.device.type == "cpu" for p in params) and _CPU_FUSED_ADAMW):
        # One kernel for the whole update. On a CPU it is several times faster than the
        # multi-tensor ("foreach") path for the book's small models (benchmarks/cpu_kernels.py);
        # the same formula, rounded differently in the last bits.
        kernel = {"fused": True}
    elif all(p.device.type == "cpu" for p in params):
        kernel = {"foreach": True}  # torch < 2.4: no fused CPU kernel
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **kernel)


def distributed_rank_and_size() -> tuple[int, int]:
    """``(rank, world_size)`` of this process under ``torch.distributed``; ``(0, 1)`` when it is not
    initialised (a plain single-process run)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _autocast(device: torch.device, amp: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when ``amp`` is set; a no-op context elsewhere."""
    if amp and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _check_data(name: str, data: Any, context_length: int, vocab_size: int | None) -> None:
    """Token ids entering training: a long enough 1-D integer tensor, in the vocabulary's range."""
    check_token_ids(name, data, dim=1)
    if len(data) < context_length + 1:
        raise ValueError(f"{name} has {len(data)} tokens; context_length={context_length} needs at least "
                         f"{context_length + 1}")
    if vocab_size is not None:
        check_id_range(name, data, vocab_size)  # once here, so no training step has to


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
    check_type("model", model, nn.Module, "torch.nn.Module")
    check_int("batch_size", batch_size)
    check_int("context_length", context_length)
    check_int("n_batches", n_batches)
    _check_data("data", data, context_length, None)
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


def _split(losses: list[torch.Tensor], world_size: int = 1) -> Iterator[float]:
    """Move a list of 0-d device tensors to Python floats with a single synchronisation; with
    several processes, each value becomes the mean over the processes (one all-reduce)."""
    if losses:
        values = torch.stack(losses).float()
        if world_size > 1:
            torch.distributed.all_reduce(values)  # sum over processes
            values = values / world_size
        yield from values.cpu().tolist()


def train(model: nn.Module, train_data: torch.Tensor, val_data: torch.Tensor | None, config: TrainConfig,
          checkpoint_path: str | os.PathLike | None = None, resume: bool = False, progress: bool = True,
          stop_at: int | None = None) -> History:
    """Train ``model`` on token ids ``train_data`` and return its :class:`History`.

    ``val_data`` (or None) is evaluated alongside the training data every ``config.eval_interval``
    steps, at step 0 and at the last step. With ``checkpoint_path``, a checkpoint is written after
    every evaluation and when the run stops; ``resume=True`` continues from it (the history then
    covers the whole run). ``stop_at`` ends this session after that many steps while keeping the
    schedule of ``config.max_steps``, so a long run can be split into sessions.

    Under ``torch.distributed`` (launched by ``torchrun``), ``config.batch_size`` is the global batch:
    it must divide by the number of processes, each of which trains on its slice; gradients are
    averaged by ``DistributedDataParallel``, the recorded batch losses over processes. Every process
    returns the same history; only rank 0 shows progress and writes the checkpoint.
    """
    check_type("model", model, nn.Module, "torch.nn.Module")
    check_type("config", config, TrainConfig, "TrainConfig")
    model_config = getattr(model, "config", None)
    vocab_size = getattr(model_config, "vocab_size", None)
    max_context = getattr(model_config, "context_length", None)
    if isinstance(max_context, int) and config.context_length > max_context:
        raise ValueError(f"config.context_length={config.context_length} exceeds the model's "
                         f"context_length={max_context}")
    _check_data("train_data", train_data, config.context_length, vocab_size)
    if val_data is not None:
        _check_data("val_data", val_data, config.context_length, vocab_size)
    check_type("checkpoint_path", checkpoint_path, (str, os.PathLike), "str, os.PathLike", optional=True)
    if check_bool("resume", resume) and checkpoint_path is None:
        raise ValueError("resume=True needs a checkpoint_path to resume from")
    check_bool("progress", progress)
    check_int("stop_at", stop_at, maximum=config.max_steps, optional=True)
    rank, world_size = distributed_rank_and_size()
    if config.batch_size % world_size:
        raise ValueError(f"config.batch_size={config.batch_size} must be divisible by the number of "
                         f"processes ({world_size}): each trains on an equal slice of the batch")
    local_batch = config.batch_size // world_size

    if config.device is not None:
        model.to(config.device)
    device = _model_device(model)
    optimizer = configure_optimizer(model, config.lr, config.weight_decay, config.betas,
                                    optimizer=config.optimizer)
    generator = torch.Generator().manual_seed(config.seed)
    history = History()
    start = 0
    if resume:
        start, history = resume_training(checkpoint_path, model, optimizer, config, generator, device)
    end = stop_at if stop_at is not None else config.max_steps
    if start > end:
        raise ValueError(f"stop_at={stop_at} is before the checkpoint's step {start}")

    forward = model
    if world_size > 1:  # gradients averaged over processes during backward
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                          broadcast_buffers=False)
    if config.compile and device.type == "cuda":
        forward = torch.compile(forward)
    params = [p for p in model.parameters() if p.requires_grad]
    clip = config.grad_clip if config.grad_clip is not None else float("inf")
    pending_loss: list[torch.Tensor] = []
    pending_norm: list[torch.Tensor] = []

    def flush() -> None:
        history.batch_loss.extend(_split(pending_loss, world_size))
        history.grad_norm.extend(_split(pending_norm))  # the same in every process
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
            if rank == 0:
                save_checkpoint(checkpoint_path, model, optimizer, step=step, train_config=config,
                                history=history, rng=rng_state(generator, device))
            if world_size > 1:
                torch.distributed.barrier()  # the file is complete before any process goes on

    with warnings.catch_warnings():
        # In a Jupyter kernel without ipywidgets, tqdm.auto warns (on stderr) and falls back to a text
        # bar; the warning would differ between a run that trains and one that loads a cached model.
        warnings.filterwarnings("ignore", message="IProgress not found")
        from tqdm.auto import tqdm

    bar = tqdm(total=config.max_steps, initial=start, disable=not progress or rank != 0, desc="training",
               unit="step")
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
            if world_size > 1:  # this process's slice of the global batch
                x, y = x[rank * local_batch:(rank + 1) * local_batch], y[rank * local_batch:(rank + 1) * local_batch]
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
