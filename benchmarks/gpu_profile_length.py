"""How long should chapter 11's GPU profile train? Trains ``lib.profiles.gpu_profile`` on
TinyShakespeare for each length given and prints the validation loss at every evaluation, the
train-validation gap at the end, and how much the loss fell over the last two evaluations.
Needs a CUDA GPU (bf16 autocast and ``torch.compile`` as chapter 11 uses them).

    python benchmarks/gpu_profile_length.py 1000 1500 2000
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import data  # noqa: E402
from lib.profiles import gpu_profile  # noqa: E402
from lib.tokenizers import CharTokenizer  # noqa: E402
from lib.training import train  # noqa: E402


def main(lengths: list[int]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: the GPU profile's numbers are what this measures")
    text = data.load_text()
    tokenizer = CharTokenizer.from_text(text)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train_ids, val_ids = data.train_val_split(ids, val_fraction=0.1)
    print(torch.__version__, torch.cuda.get_device_name(0))
    for steps in lengths:
        profile = gpu_profile(tokenizer.vocab_size, max_steps=steps)
        torch.manual_seed(0)
        model = profile.new_model().to("cuda")
        start = time.perf_counter()
        history = train(model, train_ids, val_ids, profile.train, progress=False)
        seconds = time.perf_counter() - start
        val, tr = history.val_loss, history.train_loss
        clipped = sum(n > profile.train.grad_clip for n in history.grad_norm) / len(history.grad_norm)
        lowest = min(range(len(val)), key=val.__getitem__)
        print(f"steps {steps}: {seconds:.0f} s  val {[round(v, 3) for v in val]}")
        print(f"   gap {val[-1] - tr[-1]:.3f}  fall over the last two evaluations "
              f"{val[-3] - val[-1]:.3f}  lowest {val[lowest]:.3f} at evaluation {lowest}  "
              f"clipped {clipped:.3f}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1000, 1500, 2000])
