"""The training loop every chapter uses: AdamW, warmup + cosine, clipping, evaluation,
checkpoints.

One call trains any ``nn.Module`` whose ``forward(x, y)`` returns ``(logits, loss)``::

    config = TrainConfig(max_steps=500, batch_size=32, context_length=64)
    history = train(model, train_ids, val_ids, config, progress=False)
    history.val_loss  # one value per evaluation, at the steps in history.step

:func:`train` is the whole loop, read top to bottom: at an evaluation step, record the
losses and save the latest (and the best) checkpoint; then one step: learning rate
(:func:`lr_at`), batch (:func:`lib.data.get_batch`, from a generator seeded with
``config.seed``), forward under autocast, backward, clip, optimizer step
(:func:`configure_optimizer`). Resume, the non-finite loss check and the checkpoint
writes (:mod:`lib.checkpoint`) are in the loop too; the functions after it only set up
the device, optimizer and progress bar; data parallelism is :mod:`lib.distributed`.

A non-finite batch loss stops the run with a ``FloatingPointError`` that names the step
whose loss it was. In one CPU process every step's loss is read at once, so the run stops
before that step changes the weights. On a GPU reading it would make the host wait for
the device at every step, so the losses stay on the device until the next evaluation (or
the end of the session), which looks through them and names the first bad step; the
weights have then moved on to that evaluation, and nothing is saved. Several processes
do the same, so that they all stop together.

Mixed precision: with ``config.amp`` the forward pass runs under bf16 autocast on a GPU
that runs bf16 natively (compute capability 8.0 or higher); an older GPU such as Colab's
T4 trains in float32 (see :func:`autocast_dtype`), and a CPU or MPS ignores ``amp``.

Progress bars: ``progress=True`` shows a ``tqdm.auto`` bar. Notebooks checked by nbval
either pass ``progress=False`` or put the call in a cell tagged ``nbval-ignore-output``.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_

from lib import distributed
from lib.checkpoint import (best_checkpoint_path, resume_training, rng_state,
                            save_checkpoint)
from lib.checks import (check_choice, check_int, check_number, check_token_data,
                        check_train_args, check_type, eval_mode, model_device)
from lib.config import OPTIMIZERS, History, TrainConfig
from lib.data import get_batch
from lib.optim import MuonAdamW

# TrainConfig and History are re-exported: chapters import them from here, with train.
__all__ = ["TrainConfig", "History", "lr_at", "configure_optimizer", "autocast_dtype",
           "evaluate", "train"]


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate for optimisation step ``step`` (0-based): linear warmup, then
    cosine decay.

    Warmup rises linearly from ``lr / warmup_steps`` (step 0) to ``lr`` (step
    ``warmup_steps - 1``); then the rate follows half a cosine from ``lr`` down to
    ``min_lr``, reached at ``max_steps`` and held after it. (No checks: ``train`` calls
    it every step with a ``config`` it has checked.)
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = config.max_steps - config.warmup_steps
    done = (step - config.warmup_steps) / decay_steps if decay_steps else 1.0
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))
    return config.min_lr + cosine * (config.lr - config.min_lr)


def configure_optimizer(model: nn.Module, lr: float, weight_decay: float,
                        betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                        optimizer: str = "adamw",
                        fused_adamw: bool | None = None) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices (weights, embeddings) only.

    Parameters with two or more dimensions decay; vectors (biases, norm gains) do not:
    shrinking a norm's gain or a bias toward zero is not the regularisation we want.
    Frozen parameters are left out. A parameter shared by two modules (tied embeddings)
    appears once.

    ``fused_adamw``: torch's one-kernel update (the same formula, rounded differently in
    the last bits). None uses it when every parameter is on CUDA; True everywhere (on a
    CPU from torch 2.4; the CPU profile asks for it, see ``TrainConfig.fused_adamw``);
    False never (torch's default kernel).

    ``optimizer='muon'`` returns a :class:`lib.optim.MuonAdamW` instead: the weights of
    the ``nn.Linear`` layers (the hidden matrices) take Muon steps, except a module
    named ``lm_head`` and any matrix shared with an ``nn.Embedding``; embeddings, the
    head, norm gains and biases take AdamW steps as above. Both use ``lr`` and
    ``weight_decay``. (torch's AdamW checks ``betas`` and ``eps``.)
    """
    check_number("lr", lr, low=0, low_open=True)
    check_number("weight_decay", weight_decay, low=0)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    if optimizer == "muon":
        return _muon_adamw(model, params, lr, weight_decay, tuple(betas), eps)
    matrices = [p for p in params if p.dim() >= 2]
    groups = [{"params": matrices, "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if fused_adamw is None:
        fused_adamw = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps,
                             fused=fused_adamw or None)


def _muon_adamw(model: nn.Module, params: list[nn.Parameter], lr: float,
                weight_decay: float, betas: tuple[float, float],
                eps: float) -> MuonAdamW:
    """Muon for the hidden ``nn.Linear`` matrices, AdamW for the rest (see
    configure_optimizer)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden = {id(m.weight) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name.split(".")[-1] != "lm_head"
              and id(m.weight) not in embedded}
    rest = [p for p in params if id(p) not in hidden]
    groups = [{"params": [p for p in params if id(p) in hidden], "use_muon": True,
               "weight_decay": weight_decay},
              {"params": [p for p in rest if p.dim() >= 2],
               "weight_decay": weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    return MuonAdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``amp`` autocasts to on ``device``: bfloat16 on a GPU that runs it
    natively (compute capability 8.0 or higher: A100, H100, RTX 30xx and later), else
    None (float32).

    ``torch.cuda.is_bf16_supported()`` is not the test: it also admits GPUs that only
    emulate bf16, such as Colab's T4 (compute capability 7.5), where it runs slower than
    float32. The book trains those in float32, which needs no loss scaling; fp16
    autocast with a GradScaler would be faster there, at the price of a scaler state in
    every step and checkpoint.
    """
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return torch.bfloat16
    return None


def _autocast(device: torch.device, amp: bool) -> contextlib.AbstractContextManager:
    """Autocast to :func:`autocast_dtype` when ``amp`` is set and there is one; else a
    no-op."""
    dtype = autocast_dtype(device) if amp else None
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _check_output(output: Any) -> None:
    """A TypeError unless a model's output is ``(logits, loss)`` with a scalar loss (looked
    at once per evaluation, on its first batch; a training run starts with one)."""
    if not (isinstance(output, (tuple, list)) and len(output) == 2
            and isinstance(output[1], torch.Tensor) and output[1].dim() == 0):
        raise TypeError("model(x, y) must return (logits, loss) with a scalar loss "
                        f"tensor, got {type(output).__name__}")


def evaluate(model: nn.Module, data: torch.Tensor, batch_size: int, context_length: int,
             n_batches: int = 10, seed: int = 0, amp: bool = True) -> float:
    """Mean loss of ``model`` over ``n_batches`` random batches of ``data`` (in eval
    mode, no grad).

    The batches come from a generator seeded with ``seed``, so repeated evaluations see
    the same windows and their differences reflect the model, not the sampling.
    """
    check_int("batch_size", batch_size)
    check_int("context_length", context_length)
    check_int("n_batches", n_batches)
    check_token_data("data", data, context_length)
    return _mean_loss(model, data, batch_size, context_length, n_batches, seed, amp)


@torch.no_grad()
def _mean_loss(model: nn.Module, data: torch.Tensor, batch_size: int, context_length: int,
               n_batches: int, seed: int, amp: bool) -> float:
    """:func:`evaluate` without its checks (``train`` checked its data once)."""
    device = model_device(model)
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros((), device=device)
    with eval_mode(model):
        for i in range(n_batches):
            x, y = get_batch(data, batch_size, context_length, generator, device)
            with _autocast(device, amp):
                output = model(x, y)
            if i == 0:
                _check_output(output)
            total += output[1].float()
    return float(total) / n_batches


def train(model: nn.Module, train_data: torch.Tensor, val_data: torch.Tensor | None,
          config: TrainConfig, checkpoint_path: str | os.PathLike | None = None,
          resume: bool = False, progress: bool = True,
          stop_at: int | None = None) -> History:
    """Train ``model`` on token ids ``train_data``; return the run's :class:`History`.

    At step 0, every ``config.eval_interval`` steps and at ``max_steps`` it records the
    loss on fixed batches and saves the run at ``checkpoint_path`` (the best so far at
    :func:`best_checkpoint_path`); ``resume=True`` goes on from there, ``stop_at=n``
    stops after n steps. A non-finite loss raises ``FloatingPointError`` naming its
    step (checked each step in one CPU process, else at evaluations and the end).
    """
    check_type("config", config, TrainConfig, "TrainConfig")
    rank, world_size = distributed.rank_and_size()
    check_train_args(model, train_data, val_data, config, checkpoint_path, resume,
                     progress, stop_at, world_size)
    device, optimizer, forward, rows = _setup(model, config, rank, world_size)
    generator = torch.Generator().manual_seed(config.seed)  # batches depend on the seed
    start, history = 0, History()
    if resume:  # weights, optimizer, random states and history from the checkpoint
        start, history = resume_training(checkpoint_path, model, optimizer, config,
                                         generator, device)
        if stop_at is not None and stop_at < start:
            raise ValueError(f"stop_at={stop_at} is before the checkpoint's step "
                             f"{start}")
    end = stop_at or config.max_steps
    # Read each step's loss at once only in one CPU process: on a GPU that would make
    # the host wait for the device every step (and one of several processes could stop
    # alone).
    read_each_step = device.type == "cpu" and world_size == 1
    pending = []  # one (loss, gradient norm) per step, on the device until read
    evals = dict(batch_size=config.batch_size, context_length=config.context_length,
                 n_batches=config.eval_batches, amp=config.amp)
    with _progress_bar(config.max_steps, start, progress and rank == 0) as bar:
        for step in range(start, end + 1):
            evaluating = ((step % config.eval_interval == 0 or step == config.max_steps)
                          and step not in history.step)  # (not the step resumed from)
            saving = evaluating or (step == end and history.step[-1] != end)
            if saving and pending:  # one sync (one all-reduce: means over processes)
                values = distributed.mean_over_processes(torch.stack(pending))
                losses, norms = values.cpu().T.tolist()
                pending.clear()
                for i, loss_value in enumerate(losses):
                    if not math.isfinite(loss_value):
                        raise _non_finite(loss_value, len(history.batch_loss) + i + 1)
                history.batch_loss.extend(losses)
                history.grad_norm.extend(norms)  # the same in every process
            best = False
            if evaluating:  # losses on fixed batches (seeds apart from the training's)
                lowest = min(history.val_loss, default=math.inf)
                history.step.append(step)
                history.train_loss.append(_mean_loss(model, train_data,
                                                     seed=config.seed + 1, **evals))
                history.val_loss.append(math.nan if val_data is None else _mean_loss(
                    model, val_data, seed=config.seed + 2, **evals))
                history.lr.append(lr_at(step, config))
                bar.set_postfix(train=history.train_loss[-1], val=history.val_loss[-1])
                best = history.val_loss[-1] < lowest  # never without validation (NaN)
            if saving and checkpoint_path is not None:  # the latest; the best at a low
                if rank == 0:
                    rng = rng_state(generator, device)
                    paths = [checkpoint_path, best_checkpoint_path(checkpoint_path)]
                    for path in paths if best else paths[:1]:
                        save_checkpoint(path, model, optimizer, step=step,
                                        train_config=config, history=history, rng=rng)
                distributed.barrier()  # files complete before any process goes on
            if step == end:
                break
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            x, y = get_batch(train_data, config.batch_size, config.context_length,
                             generator, device, rows)  # (B, T) each
            with _autocast(device, config.amp):
                _, loss = forward(x, y)
            if read_each_step and not math.isfinite(loss.item()):
                raise _non_finite(loss.item(), step + 1)  # before the update
            loss.backward()  # under DDP, gradients are averaged over processes here
            norm = clip_grad_norm_(model.parameters(), config.grad_clip or math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append(torch.stack([loss.detach().float(), norm.float()]))
            bar.update(1)
    return history


def _non_finite(loss: float, step: int) -> FloatingPointError:
    """The error :func:`train` raises when the loss of ``step`` (1-based) is not finite."""
    return FloatingPointError(f"the training loss became {loss} at step {step} (the batch "
                              f"of history.batch_loss[{step - 1}]); try a lower config.lr "
                              "or grad_clip")


def _setup(model: nn.Module, config: TrainConfig, rank: int, world_size: int
           ) -> tuple[torch.device, torch.optim.Optimizer, nn.Module, slice]:
    """What :func:`train` runs: the device (``cuda:LOCAL_RANK`` under torchrun) with the
    model on it in training mode, the optimizer, the module whose call runs the forward
    pass (in ``DistributedDataParallel`` under several processes, compiled on CUDA when
    ``config.compile``) and the rows of each batch this process trains on."""
    device = torch.device(config.device) if config.device else model_device(model)
    device = distributed.local_device(device)
    model.to(device).train()
    optimizer = configure_optimizer(model, config.lr, config.weight_decay, config.betas,
                                    optimizer=config.optimizer,
                                    fused_adamw=config.fused_adamw)
    forward = distributed.wrap(model, device) if world_size > 1 else model
    if config.compile and device.type == "cuda":
        forward = torch.compile(forward)
    return device, optimizer, forward, distributed.batch_rows(config.batch_size, rank,
                                                              world_size)


def _progress_bar(total: int, initial: int, show: bool) -> Any:
    with warnings.catch_warnings():
        # In a Jupyter kernel without ipywidgets, tqdm.auto warns (on stderr) and falls
        # back to a text bar; the warning would differ between a run that trains and one
        # that loads a cached model.
        warnings.filterwarnings("ignore", message="IProgress not found")
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, disable=not show, desc="training",
                    unit="step")
