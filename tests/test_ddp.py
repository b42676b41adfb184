"""Data-parallel training: two CPU processes (torchrun, gloo) with half the batch each compute the
same run as one process with the whole batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lib.checkpoint import load_checkpoint
from lib.model import GPT, GPTConfig
from lib.training import TrainConfig, distributed_rank_and_size, train

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(vocab_size=11, context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64)
CONFIG = dict(max_steps=6, batch_size=8, context_length=16, lr=3e-3, min_lr=3e-4, warmup_steps=2,
              eval_interval=3, eval_batches=2, seed=5)


def _data() -> torch.Tensor:
    return torch.arange(600) * 7 % 11  # a repeating pattern the model can learn


WORKER = textwrap.dedent(
    """
    import json, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from lib.model import GPT, GPTConfig
    from lib.training import TrainConfig, distributed_rank_and_size, train

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = distributed_rank_and_size()
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = GPT(GPTConfig(**{model}))
    data = torch.arange(600) * 7 % 11
    history = train(model, data, data, TrainConfig(**{config}), checkpoint_path={ckpt!r},
                    progress=True)
    state = {{k: v.tolist() for k, v in model.state_dict().items()}}
    with open({out!r} + f".{{rank}}.json", "w") as f:
        json.dump({{"rank": rank, "world": world, "history": history.as_dict(), "state": state}}, f)
    dist.destroy_process_group()
    """
)


def test_outside_torchrun_the_process_is_rank_0_of_1():
    assert distributed_rank_and_size() == (0, 1)


def test_two_processes_with_half_the_batch_match_one_process(tmp_path):
    script = tmp_path / "worker.py"
    out = str(tmp_path / "result")
    ckpt = str(tmp_path / "ddp.safetensors")
    script.write_text(WORKER.format(root=str(ROOT), model=MODEL, config=CONFIG, ckpt=ckpt, out=out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    # only rank 0 shows a progress bar
    assert result.stderr.count("6/6") >= 1
    assert ranks[0]["history"] == ranks[1]["history"]

    torch.manual_seed(0)
    single = GPT(GPTConfig(**MODEL))
    history = train(single, _data(), _data(), TrainConfig(**CONFIG), progress=False)
    for name, value in single.state_dict().items():
        for r in ranks:
            torch.testing.assert_close(torch.tensor(r["state"][name]), value, rtol=1e-4, atol=1e-5)
    ddp_history = ranks[0]["history"]
    assert ddp_history["step"] == history.step
    for key in ("batch_loss", "grad_norm", "train_loss", "val_loss"):
        torch.testing.assert_close(torch.tensor(ddp_history[key]), torch.tensor(getattr(history, key)),
                                   rtol=1e-4, atol=1e-5)
    # the checkpoint rank 0 wrote holds the final weights
    check = GPT(GPTConfig(**MODEL))
    assert load_checkpoint(ckpt, check).step == CONFIG["max_steps"]
    for name, value in check.state_dict().items():
        torch.testing.assert_close(value, torch.tensor(ranks[0]["state"][name]))


def test_a_batch_that_does_not_split_evenly_is_rejected(monkeypatch):
    import lib.training as training

    monkeypatch.setattr(training, "distributed_rank_and_size", lambda: (0, 3))
    model = GPT(GPTConfig(**MODEL))
    with pytest.raises(ValueError, match="batch_size=8 must be divisible by the number of processes"):
        train(model, _data(), None, TrainConfig(**CONFIG), progress=False)
