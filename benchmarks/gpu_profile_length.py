"""How long should chapter 11's GPU profile train? Trains ``lib.profiles.gpu_profile`` on
TinyShakespeare (seed 0, one uninterrupted ``train`` call per length; chapter 11 trains the same
run in three resumed sessions) and prints the validation loss at every evaluation, the
validation - train gap at the end, how much the loss fell over the last two evaluations and the
share of clipped steps. Needs a CUDA GPU (bf16 autocast and ``torch.compile`` as chapter 11 uses
them). The lengths come from the STEPS variable:

    STEPS=1000,1500,2000 python benchmarks/gpu_profile_length.py

This is the script that made docs/benchmarks.md's GPU table (run from the repository root).
"""
import os, sys, time, math, torch
sys.path.insert(0, os.getcwd())
from lib import data
from lib.tokenizers import CharTokenizer
from lib.profiles import gpu_profile
from lib.training import train
text = data.load_text()
tok = CharTokenizer.from_text(text)
ids = torch.tensor(tok.encode(text), dtype=torch.long)
train_ids, val_ids = data.train_val_split(ids, val_fraction=0.1)
V = tok.vocab_size
for steps in [int(s) for s in os.environ.get("STEPS", "1000,1500,2000").split(",")]:
    prof = gpu_profile(V, max_steps=steps)
    torch.manual_seed(0)
    model = prof.new_model().to("cuda")
    t = time.time()
    h = train(model, train_ids, val_ids, prof.train, progress=False)
    clipped = sum(n > prof.train.grad_clip for n in h.grad_norm) / len(h.grad_norm)
    v, tr = h.val_loss, h.train_loss
    print(f"steps {steps}: {time.time()-t:.0f}s  val {[round(x,3) for x in v]}")
    print(f"   train {[round(x,3) for x in tr]}")
    print(f"   gap {v[-1]-tr[-1]:.3f}  fall over last 2 evals {v[-3]-v[-1]:.3f}  val[1] {v[1]:.3f} "
          f"clipped {clipped:.3f}  min val {min(v):.3f} at eval {v.index(min(v))}", flush=True)
