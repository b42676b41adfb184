"""Argument checks shared by every module of the library.

Each checker looks at one argument, returns it (converted where that helps, e.g. an int number to
a float) and otherwise raises an error that names the argument and says what is allowed::

    n_heads = check_int("n_heads", n_heads)                 # an int >= 1
    top_p = check_number("top_p", top_p, 0, 1, low_open=True, optional=True)   # None or (0, 1]

Keeping them here lets the other modules read like the computation they implement. ``bool`` is
a subclass of ``int`` in Python; every numeric checker refuses it, so ``n_heads=True`` is an error
rather than one head.

Range checks on token ids (:func:`check_id_range`) read the values. On a GPU that means waiting
for every queued kernel, so they run where data enters the library (``train``, ``generate``,
``evaluate``), never inside ``forward``.

Three helpers here are not checks: :func:`eval_mode`, the context manager every function uses that
must run a model with dropout off and then give it back in the mode it was in;
:func:`torch_threads`, which sets torch's CPU threads inside a block and restores them; and
:func:`model_device`, the device of a model's parameters.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import torch


def _describe(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return "finite"


def check_int(name: str, value: Any, minimum: int | None = 1, maximum: int | None = None,
              optional: bool = False) -> Any:
    """``value`` if it is an int in ``[minimum, maximum]`` (None: unbounded; None itself allowed when
    ``optional``); else ValueError."""
    if optional and value is None:
        return None
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value
    if minimum is not None and maximum is not None:
        what = f"an int in [{minimum}, {maximum}]"
    elif minimum is not None:
        what = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
    else:
        what = "an int" if maximum is None else f"an int <= {maximum}"
    raise ValueError(f"{name} must be {'None or ' if optional else ''}{what}, got {value!r}")


def check_number(name: str, value: Any, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, optional: bool = False) -> Any:
    """``value`` as a float if it is a finite real number in the given interval (None allowed when
    ``optional``); else a ValueError such as "top_p must be None or a number in (0, 1]"."""
    if optional and value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = ((low is None or (value > low if low_open else value >= low))
              and (high is None or (value < high if high_open else value <= high)))
    if not ok:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}a number "
                         f"{_describe(low, high, low_open, high_open)}, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is True or False; else ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: Any, allowed: Sequence[Any]) -> Any:
    """``value`` if it is one of ``allowed``; else ValueError listing them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_type(name: str, value: Any, types: type | tuple[type, ...], what: str | None = None,
               optional: bool = False) -> Any:
    """``value`` if it is an instance of ``types`` (or None when ``optional``); else a TypeError
    "name must be a <what>, got <type>" (``what`` defaults to the class names)."""
    if (optional and value is None) or isinstance(value, types):
        return value
    if what is None:
        what = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
    raise TypeError(f"{name} must be a {what}{' or None' if optional else ''}, "
                    f"got {type(value).__name__}")


def check_divisible(name: str, value: int, by_name: str, by: int) -> None:
    """ValueError unless ``by`` divides ``value``, e.g. "d_model (30) must be divisible by n_heads (4)"."""
    if value % by:
        raise ValueError(f"{name} ({value}) must be divisible by {by_name} ({by})")


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``with eval_mode(model):`` runs the block with ``model.eval()`` (dropout off), then puts
    back the mode the model had, training or not, even if the block raises."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Inside, torch uses ``n`` CPU threads (None: unchanged); the setting is restored."""
    before = torch.get_num_threads()
    try:
        if n is not None:
            torch.set_num_threads(n)
        yield
    finally:
        torch.set_num_threads(before)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without any)."""
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def check_token_ids(name: str, ids: Any, dim: int | None = None,
                    nonempty: bool = False) -> torch.Tensor:
    """``ids`` if it is an integer tensor (of ``dim`` dimensions when given; with ``nonempty`` at
    least one id along the last dimension); else TypeError/ValueError.

    Only the type and shape are looked at, which costs nothing; see :func:`check_id_range` for the
    values.
    """
    integer = isinstance(ids, torch.Tensor) and not (
        ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
    if not integer:
        raise TypeError(f"{name} must be an integer tensor of token ids, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if dim is not None and ids.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-D tensor of token ids, got shape {tuple(ids.shape)}")
    if nonempty and (ids.dim() == 0 or ids.size(-1) == 0):
        raise ValueError(f"{name} must hold at least one token id per row, got shape "
                         f"{tuple(ids.shape)}")
    return ids


def check_id_range(name: str, ids: torch.Tensor, vocab_size: int,
                   ignore_index: int | None = None) -> None:
    """ValueError unless every id lies in ``[0, vocab_size)`` (ids equal to ``ignore_index`` aside).

    Reads the values: on a GPU this waits for the device, so call it where data enters, not per step.
    """
    if ignore_index is not None:
        ids = ids[ids != ignore_index]
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds token id {bad}, out of range [0, vocab_size={vocab_size})")


def check_token_data(name: str, data: Any, context_length: int, vocab_size: int | None = None) -> None:
    """Token ids entering training or evaluation: a 1-D integer tensor of at least
    ``context_length + 1`` ids (one window and its target), in ``[0, vocab_size)`` when given."""
    check_token_ids(name, data, dim=1)
    if len(data) < context_length + 1:
        raise ValueError(f"{name} has {len(data)} tokens; context_length={context_length} needs at "
                         f"least {context_length + 1}")
    if vocab_size is not None:
        check_id_range(name, data, vocab_size)  # once here, so no training step has to


def check_train_args(model: Any, train_data: Any, val_data: Any, config: Any, checkpoint_path: Any,
                     resume: Any, progress: Any, stop_at: Any, world_size: int) -> None:
    """The arguments of :func:`lib.training.train` (``config`` already a ``TrainConfig``), checked
    once where they enter, against the model's ``config`` where it has one."""
    import os

    check_type("model", model, torch.nn.Module, "torch.nn.Module")
    model_config = getattr(model, "config", None)
    max_context = getattr(model_config, "context_length", None)
    if isinstance(max_context, int) and config.context_length > max_context:
        raise ValueError(f"config.context_length={config.context_length} exceeds the model's "
                         f"context_length={max_context}")
    vocab_size = getattr(model_config, "vocab_size", None)
    check_token_data("train_data", train_data, config.context_length, vocab_size)
    if val_data is not None:
        check_token_data("val_data", val_data, config.context_length, vocab_size)
    check_type("checkpoint_path", checkpoint_path, (str, os.PathLike), "str, os.PathLike",
               optional=True)
    if check_bool("resume", resume) and checkpoint_path is None:
        raise ValueError("resume=True needs a checkpoint_path to resume from")
    check_bool("progress", progress)
    check_int("stop_at", stop_at, maximum=config.max_steps, optional=True)
    if config.batch_size % world_size:
        raise ValueError(f"config.batch_size={config.batch_size} must be divisible by the number of "
                         f"processes ({world_size}): each trains on an equal slice of the batch")
