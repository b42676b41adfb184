"""Run pytest on fake CUDA: ``python -m tests.fakecuda --capability 7.5 tests/test_cuda.py``.

The shim is built (cached) and loaded before torch is imported, ``torch.cuda`` reports one GPU
of the capability, and ``cuda`` tensors hold CPU values (:mod:`tests.fakecuda.wrapper`).
"""
import argparse
import sys

from tests import fakecuda


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--capability", default="8.0", help="7.5 (T4) or 8.0 (A100)")
    parser.add_argument("--no-wrapper", action="store_true",
                        help="FakeTensorMode only: no value-holding cuda tensors, torch.compile real")
    args, rest = parser.parse_known_args(argv)
    fakecuda.load_shim()
    import os

    os.environ[fakecuda.CAPABILITY_ENV] = args.capability
    if args.no_wrapper:
        fakecuda.patch_torch_cuda(fakecuda.parse_capability(args.capability))
    else:
        fakecuda.activate_from_env()
    import pytest

    return pytest.main(rest)


if __name__ == "__main__":
    sys.exit(main())
