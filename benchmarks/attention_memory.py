"""Peak memory of attention: the explicit formula vs the fused ``F.scaled_dot_product_attention``.

For each sequence length T (default 1024, 2048, 4096) and each path, a fresh Python process builds
one ``lib.attention.MultiHeadAttention`` with the tiny model's shape (d_model 128, 4 heads of 32
dims), an input ``(1, T, 128)``, and then runs either a forward pass without gradients
("inference") or a forward and backward pass ("training").

How memory is measured: torch allocates on the CPU through the system allocator, which Python's
``tracemalloc`` does not see. Instead the child process resets the kernel's peak-resident-set
counter (``/proc/self/clear_refs`` with "5") right before the pass and reads ``VmHWM`` from
``/proc/self/status`` right after it; the figure reported is that peak minus the resident set just
before the pass (``VmRSS``), i.e. the extra memory the pass needed at its worst moment. This is
Linux-only and counts pages actually touched, so it is a measurement of the process, not of torch's
allocator. For scale the script also prints the size of one ``(B, H, T, T)`` float32 score matrix,
which the explicit path materialises several times (scores, masked scores, softmax weights).

    .venv/bin/python benchmarks/attention_memory.py [--lengths 1024 2048 4096]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from lib.attention import MultiHeadAttention

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

T, fast, mode = int(sys.argv[2]), sys.argv[3] == "fused", sys.argv[4]
torch.manual_seed(0)
attn = MultiHeadAttention(128, 4)
attn.fused = fast
x = torch.randn(1, T, 128, requires_grad=(mode == "training"))
# Warm up on a short input so one-time allocations (kernels, thread pools) are not counted.
with torch.no_grad():
    attn(torch.randn(1, 8, 128))
before = kib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current resident set
if mode == "training":
    out, _ = attn(x)
    out.sum().backward()
else:
    with torch.no_grad():
        out, _ = attn(x)
peak = kib("VmHWM")
print(json.dumps({"extra_mib": (peak - before) / 1024}))
"""


def measure(T: int, path: str, mode: str) -> float:
    result = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(T), path, mode],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["extra_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    args = parser.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("this benchmark reads /proc/self/status and needs Linux")
    import torch

    print(f"torch {torch.__version__}; MultiHeadAttention(d_model=128, n_heads=4), batch 1, float32, CPU")
    print("extra peak resident memory of one pass (MiB), fresh process per cell")
    print(f"{'T':>6} {'scores (MiB)':>13} | {'inference':^27} | {'training (fwd+bwd)':^27}")
    columns = f"{'explicit':>8} {'fused':>8} {'ratio':>8}"
    print(f"{'':>6} {'':>13} | {columns} | {columns}")
    for T in args.lengths:
        scores_mib = 1 * 4 * T * T * 4 / 2**20  # (B, H, T, T) float32
        row = [f"{T:>6} {scores_mib:>13.0f} |"]
        for mode in ("inference", "training"):
            explicit, fused = measure(T, "explicit", mode), measure(T, "fused", mode)
            cell = f"{explicit:>8.1f} {fused:>8.1f} {explicit / max(fused, 0.1):>7.1f}x"
            row.append(cell + (" |" if mode == "inference" else ""))
        print(" ".join(row), flush=True)


if __name__ == "__main__":
    main()
