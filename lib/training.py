"""The training loop every chapter uses: AdamW, warmup + cosine, clipping, evaluation,
checkpoints.

One call trains any ``nn.Module`` whose ``forward(x, y)`` returns ``(logits, loss)``::

    config = TrainConfig(max_steps=500, batch_size=32, context_length=64)
    history = train(model, train_ids, val_ids, config, progress=False)
    history.val_loss  # one value per evaluation, at the steps in history.step

:func:`train` is the loop, readable on one screen: learning rate (:func:`lr_at`), batch
(:func:`lib.data.get_batch`, from a generator seeded with ``config.seed``), forward
under autocast, backward, clip, AdamW step (:func:`configure_optimizer`), log. What
happens around the steps (evaluating on fixed batches, recording the :class:`History`,
writing checkpoints, the progress bar) is the small class :class:`_Log`; data
parallelism is :mod:`lib.distributed`; checkpoint files are :mod:`lib.checkpoint`.

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

from lib import distributed
from lib.checkpoint import (best_checkpoint_path, resume_training, rng_state,
                            save_checkpoint)
from lib.checks import (check_bool, check_choice, check_int, check_number, eval_mode,
                        check_token_data, check_train_args, check_type)
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
    ``min_lr``, reached at ``max_steps`` and held after it.
    """
    check_int("step", step, minimum=0)
    check_type("config", config, TrainConfig, "TrainConfig")
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = config.max_steps - config.warmup_steps
    done = (step - config.warmup_steps) / decay_steps if decay_steps else 1.0
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))
    return config.min_lr + cosine * (config.lr - config.min_lr)


def configure_optimizer(model: nn.Module, lr: float, weight_decay: float,
                        betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                        optimizer: str = "adamw",
                        fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices (weights, embeddings) only.

    Parameters with two or more dimensions decay; vectors (biases, norm gains) do not:
    shrinking a norm's gain or a bias toward zero is not the regularisation we want.
    Frozen parameters are left out. A parameter shared by two modules (tied embeddings)
    appears once.

    ``fused``: torch's one-kernel update (the same formula, rounded differently in the
    last bits). None uses it when every parameter is on CUDA; True everywhere (on a CPU
    from torch 2.4; the CPU profile asks for it, see ``TrainConfig.fused_adamw``); False
    never (torch's default kernel).

    ``optimizer='muon'`` returns a :class:`lib.optim.MuonAdamW` instead: the weights of
    the ``nn.Linear`` layers (the hidden matrices) take Muon steps, except a module
    named ``lm_head`` and any matrix shared with an ``nn.Embedding``; embeddings, the
    head, norm gains and biases take AdamW steps as above. Both use ``lr`` and
    ``weight_decay``.
    """
    check_type("model", model, nn.Module, "torch.nn.Module")
    check_number("lr", lr, low=0, low_open=True)
    check_number("weight_decay", weight_decay, low=0)
    check_number("eps", eps, low=0, low_open=True)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    if fused is not None:
        check_bool("fused", fused)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    if optimizer == "muon":
        return _muon_adamw(model, params, lr, weight_decay, tuple(betas), eps)
    matrices = [p for p in params if p.dim() >= 2]
    groups = [{"params": matrices, "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if fused is None:
        fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps,
                             fused=fused or None)


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


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _loss_of(output: Any) -> torch.Tensor:
    """The loss from a model's ``(logits, loss)`` output, or a TypeError saying what was
    expected."""
    if not (isinstance(output, (tuple, list)) and len(output) == 2
            and isinstance(output[1], torch.Tensor) and output[1].dim() == 0):
        raise TypeError("model(x, y) must return (logits, loss) with a scalar loss "
                        f"tensor, got {type(output).__name__}")
    return output[1]


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, batch_size: int, context_length: int,
             n_batches: int = 10, seed: int = 0, amp: bool = True) -> float:
    """Mean loss of ``model`` over ``n_batches`` random batches of ``data`` (in eval
    mode, no grad).

    The batches come from a generator seeded with ``seed``, so repeated evaluations see
    the same windows and their differences reflect the model, not the sampling.
    """
    check_type("model", model, nn.Module, "torch.nn.Module")
    check_int("batch_size", batch_size)
    check_int("context_length", context_length)
    check_int("n_batches", n_batches)
    check_token_data("data", data, context_length)
    device = _model_device(model)
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros((), device=device)
    with eval_mode(model):
        for _ in range(n_batches):
            x, y = get_batch(data, batch_size, context_length, generator, device)
            with _autocast(device, amp):
                total += _loss_of(model(x, y)).float()
    return float(total) / n_batches


def train(model: nn.Module, train_data: torch.Tensor, val_data: torch.Tensor | None,
          config: TrainConfig, checkpoint_path: str | os.PathLike | None = None,
          resume: bool = False, progress: bool = True,
          stop_at: int | None = None) -> History:
    """Train ``model`` on token ids ``train_data`` and return its :class:`History`.

    ``val_data`` (or None) is evaluated with the training data every
    ``config.eval_interval`` steps, at step 0 and at the last step. With
    ``checkpoint_path`` a checkpoint is written there after every evaluation and when
    the run stops, and the one of the lowest validation loss so far is kept at
    :func:`lib.checkpoint.best_checkpoint_path`. ``resume=True`` continues from
    ``checkpoint_path`` (the history then covers the whole run); ``stop_at`` ends this
    session after that many steps, keeping the schedule of ``config.max_steps``. Under
    ``torchrun`` each process trains on its own GPU and its slice of the global batch
    (:mod:`lib.distributed`); only rank 0 shows progress and writes checkpoints.
    """
    check_type("config", config, TrainConfig, "TrainConfig")
    rank, world_size = distributed.rank_and_size()
    check_train_args(model, train_data, val_data, config, checkpoint_path, resume,
                     progress, stop_at, world_size)
    device = torch.device(config.device) if config.device else _model_device(model)
    device = distributed.local_device(device)  # cuda:LOCAL_RANK under torchrun
    model.to(device)
    optimizer = configure_optimizer(model, config.lr, config.weight_decay, config.betas,
                                    optimizer=config.optimizer,
                                    fused=config.fused_adamw)
    generator = torch.Generator().manual_seed(config.seed)  # batches depend on the seed
    forward = distributed.wrap(model, device) if world_size > 1 else model
    if config.compile and device.type == "cuda":
        forward = torch.compile(forward)
    rows = distributed.batch_rows(config.batch_size, rank, world_size)  # this process
    clip = config.grad_clip or math.inf
    data = (train_data, val_data)
    with _Log(model, optimizer, generator, config, data, checkpoint_path,
              show=progress and rank == 0) as log:
        start = log.start(resume)  # 0, or the step the checkpoint reached
        end = config.max_steps if stop_at is None else stop_at
        if start > end:
            raise ValueError(f"stop_at={stop_at} is before the checkpoint's step "
                             f"{start}")
        model.train()
        for step in range(start, end):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            x, y = get_batch(train_data, config.batch_size, config.context_length,
                             generator, device, rows)  # (B, T) each
            with _autocast(device, config.amp):
                loss = _loss_of(forward(x, y))
            loss.backward()  # under DDP, gradients are averaged over processes here
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.step(loss, norm)
            if (step + 1) % config.eval_interval == 0 or step + 1 == config.max_steps:
                log.evaluate(step + 1)
        log.stop(end)
    return log.history


class _Log:
    """Everything :func:`train` does around the steps: the per-step losses and gradient
    norms (kept on the device until the next evaluation, so the loop never waits for a
    GPU), evaluations on fixed batches, the :class:`History`, the latest and the best
    checkpoint, the progress bar."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 generator: torch.Generator, config: TrainConfig,
                 data: tuple[torch.Tensor, torch.Tensor | None],
                 path: str | os.PathLike | None, show: bool) -> None:
        self.model, self.optimizer = model, optimizer
        self.generator, self.config = generator, config
        self.train_data, self.val_data = data
        self.path = path
        self.history = History()
        self.pending: list[torch.Tensor] = []
        self.first = 0
        self.bar = _progress_bar(config.max_steps, show)

    def __enter__(self) -> "_Log":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

    def start(self, resume: bool) -> int:
        """Resume from the checkpoint (returns its step), or measure the untrained model
        (returns 0)."""
        if resume:
            self.first, self.history = resume_training(
                self.path, self.model, self.optimizer, self.config, self.generator,
                _model_device(self.model))
            self.bar.update(self.first)
        else:
            self.evaluate(0)
        return self.first

    def step(self, loss: torch.Tensor, norm: torch.Tensor) -> None:
        self.pending.append(torch.stack([loss.detach().float(), norm.detach().float()]))
        self.bar.update(1)

    def _flush(self) -> None:
        """Move the pending values to the history with one synchronisation (and, with
        several processes, one all-reduce: the batch losses become means over them)."""
        if self.pending:
            values = distributed.mean_over_processes(torch.stack(self.pending))
            losses, norms = values.cpu().T.tolist()
            self.history.batch_loss.extend(losses)
            self.history.grad_norm.extend(norms)  # the same in every process
            self.pending.clear()
            if not math.isfinite(self.history.batch_loss[-1]):
                raise FloatingPointError(
                    f"the training loss became {self.history.batch_loss[-1]} by step "
                    f"{len(self.history.batch_loss)}; try a lower config.lr or "
                    "grad_clip")

    def evaluate(self, step: int) -> None:
        """Record the losses on fixed batches after ``step`` steps; write the
        checkpoints."""
        self._flush()
        config, history = self.config, self.history
        kwargs = dict(batch_size=config.batch_size,
                      context_length=config.context_length,
                      n_batches=config.eval_batches, amp=config.amp)
        best = min(history.val_loss, default=math.inf)
        history.step.append(step)
        history.train_loss.append(
            evaluate(self.model, self.train_data, seed=config.seed + 1, **kwargs))
        history.val_loss.append(
            math.nan if self.val_data is None
            else evaluate(self.model, self.val_data, seed=config.seed + 2, **kwargs))
        history.lr.append(lr_at(step, config))
        self.bar.set_postfix(train=f"{history.train_loss[-1]:.3f}",
                             val=f"{history.val_loss[-1]:.3f}")
        self._save(step, self.path)
        if history.val_loss[-1] < best:  # never true without validation data (NaN)
            self._save(step, best_checkpoint_path(self.path) if self.path else None)

    def stop(self, end: int) -> None:
        """End of the session: flush, and keep the state for resume if it stopped
        between evaluations."""
        self._flush()
        if end > self.first and self.history.step[-1] != end:
            self._save(end, self.path)

    def _save(self, step: int, path: str | os.PathLike | None) -> None:
        if path is None:
            return
        if distributed.rank_and_size()[0] == 0:
            rng = rng_state(self.generator, _model_device(self.model))
            save_checkpoint(path, self.model, self.optimizer, step=step,
                            train_config=self.config, history=self.history, rng=rng)
        distributed.barrier()  # the file is complete before any process goes on


def _progress_bar(total: int, show: bool) -> Any:
    with warnings.catch_warnings():
        # In a Jupyter kernel without ipywidgets, tqdm.auto warns (on stderr) and falls
        # back to a text bar; the warning would differ between a run that trains and one
        # that loads a cached model.
        warnings.filterwarnings("ignore", message="IProgress not found")
        from tqdm.auto import tqdm

        return tqdm(total=total, disable=not show, desc="training", unit="step")
