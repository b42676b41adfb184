"""A sliding window with attention sinks, switched on for every attention layer of a
model.

With a window of ``w`` each query sees only the ``w`` most recent positions (itself
included), so the KV cache a model needs stops growing (Mistral 7B). ``sinks`` keeps the
first positions of the sequence visible as well (StreamingLLM's attention sinks). The
mask itself is :func:`lib.attention.attention_mask`; this module only sets every layer's
``window`` and ``sinks``.
"""
from __future__ import annotations

from torch import nn

from lib.attention import MultiHeadAttention
from lib.checks import check_int, check_type

__all__ = ["set_window"]


def set_window(model: nn.Module, window: int | None, sinks: int = 0) -> int:
    """Give every :class:`lib.attention.MultiHeadAttention` in ``model`` a sliding
    ``window`` of that many recent positions plus ``sinks`` attention sinks (the
    first positions of the sequence); ``window=None`` restores full causal attention
    (``sinks`` must then be 0). Returns the number of attention layers changed."""
    check_type("model", model, nn.Module, "torch.nn.Module")
    check_int("window", window, optional=True)
    check_int("sinks", sinks, minimum=0)
    if window is None and sinks:
        raise ValueError(f"sinks={sinks} needs a window (sinks only matter when old "
                         f"positions are hidden)")
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    for layer in layers:
        layer.window, layer.sinks = window, sinks
    return len(layers)
