"""Data-parallel training helpers: which process this is, which device it owns, which rows it trains.

:func:`lib.training.train` needs four things when ``torchrun`` starts several processes with
``torch.distributed`` initialised, and each is one small function here:

* :func:`rank_and_size`: ``(rank, world_size)``, ``(0, 1)`` in a plain single-process run;
* :func:`local_device`: each process's own GPU, ``cuda:LOCAL_RANK`` (torchrun numbers the processes
  of one machine 0, 1, ... in the environment variable ``LOCAL_RANK``), made the current device so
  that every CUDA call of the process lands there and not on ``cuda:0``;
* :func:`batch_rows`: the rows of the global batch this process trains on: every process draws the
  same ``batch_size`` windows from the same seeded generator and keeps its contiguous slice, so N
  processes compute the run of one process (to float rounding);
* :func:`wrap` (``DistributedDataParallel``, which averages the gradients during ``backward``),
  :func:`mean_over_processes` (one all-reduce for the recorded losses) and :func:`barrier`.
"""
from __future__ import annotations

import os

import torch
from torch import nn

__all__ = ["rank_and_size", "local_device", "batch_rows", "wrap", "mean_over_processes", "barrier"]


def rank_and_size() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` when ``torch.distributed`` is not
    initialised (a plain single-process run)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_device(device: torch.device) -> torch.device:
    """The device this process trains on: under several processes a CUDA ``device`` becomes
    ``cuda:LOCAL_RANK`` and is made current; anything else is returned unchanged."""
    if device.type != "cuda" or rank_and_size()[1] == 1:
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def batch_rows(batch_size: int, rank: int, world_size: int) -> slice:
    """The rows of a global batch of ``batch_size`` that process ``rank`` of ``world_size`` trains
    on (``batch_size`` divides by ``world_size``; :func:`lib.checks.check_train_args` checks it)."""
    local = batch_size // world_size
    return slice(rank * local, (rank + 1) * local)


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` in ``DistributedDataParallel``: gradients are averaged over the processes during
    ``backward``, so every process takes the same optimiser step."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


def mean_over_processes(values: torch.Tensor) -> torch.Tensor:
    """``values`` averaged element-wise over the processes (one all-reduce); unchanged in a
    single-process run."""
    world_size = rank_and_size()[1]
    if world_size > 1:
        values = values.clone()
        torch.distributed.all_reduce(values)  # the sum over processes
        values = values / world_size
    return values


def barrier() -> None:
    """Wait until every process reaches this point (e.g. until rank 0 has written a file)."""
    if rank_and_size()[1] > 1:
        torch.distributed.barrier()
