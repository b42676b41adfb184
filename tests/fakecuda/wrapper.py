"""Tensors that claim ``cuda:0`` and hold real CPU values: CUDA code that reads values (train,
generate, evaluate, the chapters) runs on the CPU while the rule that tensors of one op share a
device holds, for tensors with dimensions, as on a GPU, and so does the rule that a random
draw's generator is on the draw's device (:class:`GeneratorDevices`). One gap: a 0-dim CPU
tensor passes every op here, while a GPU accepts it only where no device check applies (e.g. ``add``, ``mul``) and refuses it in ops
that check, e.g. ``index_select``/``embedding``, ``gather``, ``addmm``'s bias, ``clamp`` with a
tensor bound, ``masked_fill``'s mask.

:class:`CudaTensor` is a wrapper subclass (``_make_wrapper_subclass`` with ``device=cuda:0``)
around a CPU tensor. Its ``__torch_dispatch__`` unwraps, runs the CPU kernel and wraps the
results; a CPU tensor with dimensions meeting it outside the copying ops raises the error a GPU
raises ("Expected all tensors to be on the same device ..."); a 0-dim CPU tensor (a scalar)
does not, in any op (see above). Random ops on the device draw from :mod:`tests.fakecuda.rng`'s stream.
Factories asked for ``device="cuda"`` reach this module through kernels registered for the
CUDA dispatch key (a CPU-only build has none): the factories in ``FACTORIES`` (``empty``,
``empty_strided``, ``zeros``, ``ones``, ``arange`` and the rest, since not every factory goes
through ``empty``) and ``as_strided``. CPU tensors never leave torch's C++ path.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from tests.fakecuda import rng

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
aten = torch.ops.aten

MISMATCH = ("Expected all tensors to be on the same device, but found at least two devices, "
            "cuda:0 and cpu!")
# Ops that legitimately take CPU tensors beside CUDA ones (copies between devices; indices).
CROSS_DEVICE = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
                aten._copy_from_and_resize.default, aten.copy.default}
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
            aten._index_put_impl_.default}
IGNORED = {aten.record_stream.default}


class GeneratorDevices(TorchFunctionMode):
    """A random draw takes a generator of its own device, as on a GPU: a CPU generator for a
    draw on the device, or the device's for a draw on the CPU, raises torch's error. Checked
    where the call is made (Python), since below it a generator loses the device it was asked
    for (the shim's generators are CPU ones; see :mod:`tests.fakecuda.rng`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if generator is not None:
            on_device = _is_cuda_device(kwargs.get("device")) or any(
                isinstance(value, CudaTensor) for value in tree_flatten(args)[0])
            wanted = "cuda" if on_device else "cpu"
            if generator.device.type != wanted:
                raise RuntimeError(f"Expected a '{wanted}' device type for generator but found "
                                   f"'{generator.device.type}'")
        return func(*args, **kwargs)


class CudaTensor(torch.Tensor):
    """A ``cuda:0`` tensor whose values live in the CPU tensor ``self.data_cpu``."""

    data_cpu: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, layout=data.layout, device=CUDA,
            requires_grad=data.requires_grad)
        self.data_cpu = data
        return self

    def __repr__(self, *, tensor_contents=None):
        text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        return "tensor" + text[len(type(self).__name__):]  # as a GPU's tensor prints

    def untyped_storage(self):  # the wrapper has none: its values' (data_ptr identifies ties)
        return self.data_cpu.untyped_storage()

    def data_ptr(self):
        return self.data_cpu.data_ptr()

    def tolist(self):
        return self.data_cpu.tolist()

    def numpy(self, *, force=False):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to "
                        "copy the tensor to host memory first.")

    def __format__(self, format_spec):  # torch's own shortcut tests `type(self) is Tensor`
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    def __reduce_ex__(self, protocol):  # torch.save / deepcopy of a GPU tensor: its values
        return (_rebuild, (self.data_cpu.detach().clone(), self.requires_grad))


def _rebuild(data, requires_grad):
    return CudaTensor(data).requires_grad_(requires_grad)


def _is_cuda_device(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _unwrap(value):
    if isinstance(value, CudaTensor):
        return value.data_cpu
    if isinstance(value, torch.device) and value.type == "cuda":
        return CPU
    return value


def _wrap(value):
    if isinstance(value, torch.Tensor) and not isinstance(value, CudaTensor) \
            and value.device.type == "cpu":
        return CudaTensor(value)
    return value


def _check_devices(func, args, kwargs) -> None:
    checked = args
    if func in INDEXING:
        checked = (args[0],) + tuple(args[2:])  # CPU indices are allowed on a GPU
    if func in CROSS_DEVICE:
        return
    for value in tree_flatten((checked, kwargs))[0]:
        if isinstance(value, torch.Tensor) and not isinstance(value, CudaTensor) \
                and value.device.type == "cpu" and value.dim() > 0:
            raise RuntimeError(MISMATCH)


def dispatch(func, args, kwargs):
    if func in IGNORED:
        return None
    if func is aten.copy_.default:  # dst.copy_(src), either side on the device
        dst, src = args[0], args[1]
        _unwrap(dst).copy_(_unwrap(src), *args[2:], **kwargs)
        return dst
    _check_devices(func, args, kwargs)
    to_device = kwargs.get("device")
    if func is aten._to_copy.default and to_device is not None and not _is_cuda_device(to_device):
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return out  # off the device: a plain tensor
    unwrapped_args, unwrapped_kwargs = tree_map(_unwrap, (args, kwargs))
    if "pin_memory" in unwrapped_kwargs:
        unwrapped_kwargs["pin_memory"] = False
    if torch.Tag.nondeterministic_seeded in func.tags:
        with rng.use_cuda_stream():
            out = func(*unwrapped_args, **unwrapped_kwargs)
    else:
        out = func(*unwrapped_args, **unwrapped_kwargs)
    if func is aten._local_scalar_dense.default:
        return out
    return _results(func, args, kwargs, out)


def _results(func, args, kwargs, out):
    """Wrap the CPU results; an in-place or out= op returns the very tensor it wrote to."""
    written = {}
    for index, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is not None and info.is_write:
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            for alias in info.before_set:
                written[alias] = value
    if not written:
        return tree_map(_wrap, out)
    outs = out if isinstance(out, tuple) else (out,)
    results = []
    for ret, value in zip(func._schema.returns, outs):
        info = ret.alias_info
        alias = next(iter(info.before_set), None) if info is not None else None
        results.append(written[alias] if alias in written else tree_map(_wrap, value))
    return tuple(results) if isinstance(out, tuple) else results[0]


def _factory(func):
    seeded = torch.Tag.nondeterministic_seeded in func.tags

    def kernel(*args, **kwargs):
        kwargs = dict(kwargs, device=CPU, pin_memory=False)
        if seeded and kwargs.get("generator") is None:
            with rng.use_cuda_stream():
                return CudaTensor(func(*args, **kwargs))
        return CudaTensor(func(*args, **kwargs))
    return kernel


_LIBRARY = None
# Factories that dispatch on their device argument alone. Each gets a CUDA kernel that builds
# the tensor on the CPU and wraps it (an out= variant would resize the CPU tensor behind the
# wrapper's back, so the whole factory is caught, not only its `empty`).
FACTORIES = ("empty.memory_format", "empty_strided", "zeros", "ones", "full", "arange",
             "arange.start", "arange.start_step", "randn", "randn.generator", "rand",
             "rand.generator", "randint", "randint.low", "randint.generator",
             "randint.low_generator", "randperm", "randperm.generator", "linspace",
             "logspace", "eye", "eye.m", "scalar_tensor", "tril_indices", "triu_indices",
             "normal.float_float")


def install() -> None:
    """Register the CUDA factory kernels (once per process)."""
    global _LIBRARY
    if _LIBRARY is not None or getattr(torch, "_fake_cuda_library", None) is not None:
        return
    # Module.to("cuda") swaps each parameter's contents (keeping the Python object, as a real
    # .to does), since a CudaTensor cannot be assigned through `param.data = ...`.
    torch.__future__.set_swap_module_params_on_conversion(True)
    # torch.tensor / as_tensor copy into a device tensor below the Python key: build on the
    # CPU and move.
    for name in ("tensor", "as_tensor"):
        setattr(torch, name, _via_cpu(getattr(torch, name)))
    # Dynamo cannot trace this subclass's Python construction: compiled code runs eagerly
    # here. The compiled CUDA path is traced under FakeTensorMode (tests/test_fake_cuda.py).
    torch.compile = _eager_compile

    _LIBRARY = torch.library.Library("aten", "IMPL")
    # Kept alive with torch (a Library unregisters its kernels when collected, and pytest may
    # drop and re-import the tests package).
    torch._fake_cuda_library = _LIBRARY
    for name in FACTORIES:
        packet, _, overload = name.partition(".")
        _LIBRARY.impl(name, _factory(getattr(getattr(aten, packet), overload or "default")),
                      "CUDA")
    _LIBRARY.impl("as_strided", _as_strided, "CUDA")
    # Entered for good: every torch call of the process passes the generator check.
    torch._fake_cuda_generator_mode = GeneratorDevices()
    torch._fake_cuda_generator_mode.__enter__()


def _eager_compile(model=None, **kwargs):
    if model is None:
        return lambda fn: fn
    return model


def _via_cpu(make):
    def made(data, *args, device=None, **kwargs):
        if _is_cuda_device(device):
            return make(data, *args, **kwargs).to(CUDA)
        return make(data, *args, device=device, **kwargs)
    made.__wrapped__ = make
    return made


def _as_strided(self, size, stride, storage_offset=None):
    """Autograd replays views of a parameter with as_strided, below the Python key: the same
    view of the CPU values (the wrapper's sizes, strides and offset mirror them)."""
    return CudaTensor(self.data_cpu.as_strided(size, stride, storage_offset))
