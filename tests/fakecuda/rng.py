"""The stand-in for CUDA's random generator: a CPU generator of its own, so that seeding,
saving and restoring "the CUDA state" (lib.checkpoint, fork_rng, dropout on the device) is a
stream apart from the CPU's, as on a GPU (its numbers differ from a real GPU's).

The shim's generators are CPU ones whatever device is asked for, so ``torch.Generator`` becomes
:class:`DeviceGenerator`, which remembers the device it was asked for and reports it as
``.device``; :mod:`tests.fakecuda.wrapper` refuses a random op on the device driven by a
generator that is not a CUDA one, and a CPU draw driven by a CUDA generator, as a GPU does.
Like torch's, ``torch.Generator("cuda").device`` is ``cuda`` with no index."""
from __future__ import annotations

import torch

GENERATOR = torch.Generator()
GENERATOR.manual_seed(torch.initial_seed())


def patch(cuda) -> None:
    cuda.manual_seed = lambda seed: GENERATOR.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: GENERATOR.manual_seed(int(seed))
    cuda.seed = lambda: GENERATOR.seed()
    cuda.seed_all = lambda: GENERATOR.seed()
    cuda.initial_seed = lambda: GENERATOR.initial_seed()
    cuda.get_rng_state = lambda device="cuda": GENERATOR.get_state()
    cuda.set_rng_state = lambda state, device="cuda": GENERATOR.set_state(state.cpu())
    cuda.get_rng_state_all = lambda: [GENERATOR.get_state()]
    cuda.set_rng_state_all = lambda states: GENERATOR.set_state(states[0].cpu())
    torch.Generator = DeviceGenerator
    import torch.cuda.random as cuda_random

    for name in ("manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state",
                 "get_rng_state_all", "set_rng_state_all", "seed", "seed_all", "initial_seed"):
        setattr(cuda_random, name, getattr(cuda, name))


class use_cuda_stream:
    """Within: torch's default CPU generator draws CUDA's stream (then both are put back)."""

    def __enter__(self):
        default = torch.default_generator
        self.cpu_state = default.get_state()
        default.set_state(GENERATOR.get_state())

    def __exit__(self, *exc):
        default = torch.default_generator
        GENERATOR.set_state(default.get_state())
        default.set_state(self.cpu_state)
        return False


class _AnyGenerator(type(torch._C.Generator)):
    """``isinstance(g, torch.Generator)`` stays true of every generator (the default ones too)
    once ``torch.Generator`` is :class:`DeviceGenerator`."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, torch._C.Generator)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, torch._C.Generator)


class DeviceGenerator(torch._C.Generator, metaclass=_AnyGenerator):
    """``torch.Generator(device)``: the shim's (CPU) generator, with the device asked for."""

    def __init__(self, device="cpu"):
        self.asked_device = torch.device(device)  # "cuda" stays index-less, as torch's

    @property
    def device(self):
        return self.asked_device

