"""A mixture of experts under DistributedDataParallel: two CPU processes (torchrun, gloo) train a tiny
MoE GPT whose router sends every token to one expert, so the other experts receive no tokens.

DDP expects a gradient for every parameter in every step; an expert skipped because it got no tokens
would leave its parameters out of the autograd graph and stop the second step with an error. The run
must finish, every step must have had idle experts, and both processes must end with the same weights.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from lib.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(vocab_size=11, context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=32,
             ffn="moe", n_experts=4, moe_top_k=1)
CONFIG = dict(max_steps=5, batch_size=8, context_length=16, lr=3e-3, min_lr=3e-4, warmup_steps=1,
              eval_interval=5, eval_batches=1, seed=3)

WORKER = textwrap.dedent(
    """
    import json, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from lib.model import GPT, GPTConfig
    from lib.distributed import rank_and_size
    from lib.training import TrainConfig, train

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = rank_and_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{model}))
    counts = []
    for block in model.blocks:
        # a frozen all-zero router ties every expert; top-1 then always picks the same one
        block.ffn.router.weight.data.zero_()
        block.ffn.router.weight.requires_grad_(False)
        block.ffn.register_forward_hook(
            lambda m, i, o: counts.append(m.expert_counts.tolist()) if m.training else None)
    data = torch.arange(600) * 7 % 11
    history = train(model, data, data, TrainConfig(**{config}), progress=False)
    state = {{k: v.tolist() for k, v in model.state_dict().items()}}
    with open({out!r} + f".{{rank}}.json", "w") as f:
        json.dump({{"rank": rank, "history": history.as_dict(), "counts": counts,
                   "state": state}}, f)
    dist.destroy_process_group()
    """
)


def test_moe_with_idle_experts_trains_under_ddp_and_ranks_agree(tmp_path):
    script = tmp_path / "worker.py"
    out = str(tmp_path / "result")
    script.write_text(WORKER.format(root=str(ROOT), model=MODEL, config=CONFIG, out=out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        # one record per layer and training step; in every one a single expert got all the tokens
        assert len(r["counts"]) == MODEL["n_layers"] * CONFIG["max_steps"]
        assert all(sorted(c)[:-1] == [0, 0, 0] for c in r["counts"])
        assert len(r["history"]["batch_loss"]) == CONFIG["max_steps"]
    assert ranks[0]["history"] == ranks[1]["history"]
    for name, value in ranks[0]["state"].items():
        torch.testing.assert_close(torch.tensor(ranks[1]["state"][name]), torch.tensor(value),
                                   rtol=0, atol=0)
    # the busy expert of layer 0 learned; the idle ones moved only by weight decay
    busy = {max(range(4), key=c.__getitem__) for c in ranks[0]["counts"][::MODEL["n_layers"]]}
    assert len(busy) == 1
    torch.manual_seed(0)
    start = GPT(GPTConfig(**MODEL)).state_dict()
    key = "blocks.0.ffn.experts.{}.w_up.weight"
    moved = [(torch.tensor(ranks[0]["state"][key.format(e)]) - start[key.format(e)]).abs().max().item()
             for e in range(4)]
    idle = [m for e, m in enumerate(moved) if e not in busy]
    assert moved[busy.pop()] > 10 * max(idle)
