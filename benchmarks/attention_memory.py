"""Peak memory of one causal attention call: explicit formula, tiled loop, fused kernel.

For each sequence length T and each method, a fresh Python process builds q, k, v of shape
``(1, 4, T, 32)`` (float32) and calls one of

- ``explicit``: ``lib.attention.scaled_dot_product_attention`` (the formula written out),
- ``tiled``: ``lib.tiled_attention.tiled_attention`` (blocks of 64, the online softmax),
- ``fused``: ``F.scaled_dot_product_attention(..., is_causal=True)`` (torch's kernel).

How memory is measured: torch allocates on the CPU through the C allocator, which Python's
``tracemalloc`` does not see. The child tells the allocator to hand every block above 16 KiB
back to the system when it is freed (``mallopt``) and to release its free pages before the call
(``malloc_trim``), resets the kernel's peak-resident-set counter (``/proc/self/clear_refs``
with "5") and reads ``VmHWM`` after the call: the figure is that peak minus the resident set
just before (``VmRSS``), the extra memory the call needed at its worst moment. Linux only.

    .venv/bin/python benchmarks/attention_memory.py [--lengths 256 512 1024 2048]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("explicit", "tiled", "fused")

CHILD = r"""
import ctypes, re, sys, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[3])
from lib.attention import scaled_dot_product_attention
from lib.tiled_attention import tiled_attention
method, n = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 16 * 1024)    # M_MMAP_THRESHOLD: big blocks go back at once
def resident(key):
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+) kB", f.read()).group(1)) * 1024
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, n, 32, generator=g) for _ in range(3))
run = {"explicit": lambda: scaled_dot_product_attention(q, k, v, causal=True)[0],
       "tiled": lambda: tiled_attention(q, k, v, 64, 64),
       "fused": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}[method]
run()                                            # warm up: first-call allocations
libc.malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                 # reset the high-water mark
before = resident("VmRSS")
out = run()
print(resident("VmHWM") - before)
"""


def available() -> bool:
    """Whether this machine can measure (Linux's /proc/self/clear_refs)."""
    return os.path.exists("/proc/self/clear_refs")


def peak_extra_bytes(method: str, n: int) -> int:
    """Extra peak resident memory of one causal attention call of length ``n``, in bytes,
    measured in a fresh process."""
    result = subprocess.run([sys.executable, "-c", CHILD, method, str(n), str(ROOT)],
                            capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1])


def measure(lengths: tuple[int, ...] = (256, 512, 1024, 2048)) -> dict[tuple[str, int], int]:
    """``{(method, T): extra bytes}`` for every method and length."""
    return {(m, n): peak_extra_bytes(m, n) for n in lengths for m in METHODS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    args = parser.parse_args()
    if not available():
        raise SystemExit("this benchmark reads /proc/self/status and needs Linux")
    memory = measure(tuple(args.lengths))
    print("extra peak resident memory of one causal attention call (MiB), 4 heads, D=32")
    print(f"{'T':>5}" + "".join(f"{m:>10}" for m in METHODS) + f"{'T x T scores':>14}")
    for n in args.lengths:
        print(f"{n:>5}" + "".join(f"{memory[m, n] / 2**20:>10.2f}" for m in METHODS)
              + f"{4 * n * n * 4 / 2**20:>14.2f}")


if __name__ == "__main__":
    main()
