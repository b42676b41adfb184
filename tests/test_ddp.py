"""Data-parallel training: two CPU processes (torchrun, gloo) with half the batch each compute the
same run as one process with the whole batch; a mixture of experts whose idle experts get no tokens
trains under DDP too; and lib.distributed's pieces (the device each process takes from LOCAL_RANK,
the rows of the batch it copies) checked one by one in one CPU process.

Both two-process runs share one torchrun launch (a module fixture): starting two Python processes
that import torch costs more than either run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lib import distributed
from lib.checkpoint import load_checkpoint
from lib.data import get_batch
from lib.distributed import rank_and_size
from lib.model import GPT, GPTConfig
from lib.training import TrainConfig, train

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(vocab_size=11, context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=64)
CONFIG = dict(max_steps=6, batch_size=8, context_length=16, lr=3e-3, min_lr=3e-4, warmup_steps=2,
              eval_interval=3, eval_batches=2, seed=5)
# A tiny MoE whose frozen all-zero router ties every expert, so top-1 always picks the same one and
# the other experts receive no tokens. DDP expects a gradient for every parameter in every step; an
# expert skipped because it got no tokens would leave its parameters out of the autograd graph and
# stop the second step with an error.
MOE_MODEL = dict(vocab_size=11, context_length=16, d_model=32, n_layers=2, n_heads=2, d_ff=32,
                 ffn="moe", n_experts=4, moe_top_k=1)
MOE_CONFIG = dict(max_steps=5, batch_size=8, context_length=16, lr=3e-3, min_lr=3e-4, warmup_steps=1,
                  eval_interval=5, eval_batches=1, seed=3)


def _data() -> torch.Tensor:
    return torch.arange(600) * 7 % 11  # a repeating pattern the model can learn


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
    data = torch.arange(600) * 7 % 11

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = GPT(GPTConfig(**{model}))
    history = train(model, data, data, TrainConfig(**{config}), checkpoint_path={ckpt!r},
                    progress=True)
    state = {{k: v.tolist() for k, v in model.state_dict().items()}}
    with open({out!r} + f".{{rank}}.json", "w") as f:
        json.dump({{"rank": rank, "world": world, "history": history.as_dict(), "state": state}}, f)

    torch.manual_seed(0)
    model = GPT(GPTConfig(**{moe_model}))
    counts = []
    for block in model.blocks:
        block.ffn.router.weight.data.zero_()
        block.ffn.router.weight.requires_grad_(False)
        block.ffn.register_forward_hook(
            lambda m, i, o: counts.append(m.expert_counts.tolist()) if m.training else None)
    history = train(model, data, data, TrainConfig(**{moe_config}), progress=False)
    state = {{k: v.tolist() for k, v in model.state_dict().items()}}
    with open({out!r} + f".moe.{{rank}}.json", "w") as f:
        json.dump({{"rank": rank, "history": history.as_dict(), "counts": counts,
                   "state": state}}, f)
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory):
    """One torchrun launch of two CPU processes running both runs; returns its stderr, the
    checkpoint path, and the per-rank results of the dense and of the MoE run."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    script = tmp_path / "worker.py"
    out = str(tmp_path / "result")
    ckpt = str(tmp_path / "ddp.safetensors")
    script.write_text(WORKER.format(root=str(ROOT), model=MODEL, config=CONFIG, ckpt=ckpt, out=out,
                                    moe_model=MOE_MODEL, moe_config=MOE_CONFIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    dense = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    moe = [json.loads(Path(f"{out}.moe.{r}.json").read_text()) for r in (0, 1)]
    return result.stderr, ckpt, dense, moe


def test_outside_torchrun_the_process_is_rank_0_of_1():
    assert rank_and_size() == (0, 1)


def test_two_processes_with_half_the_batch_match_one_process(torchrun):
    stderr, ckpt, ranks, _ = torchrun
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    # only rank 0 shows a progress bar
    assert stderr.count("6/6") >= 1
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


def test_moe_with_idle_experts_trains_under_ddp_and_ranks_agree(torchrun):
    """The MoE run must finish, every step must have had idle experts, and both processes must
    end with the same weights."""
    ranks = torchrun[3]
    for r in ranks:
        # one record per layer and training step; in every one a single expert got all the tokens
        assert len(r["counts"]) == MOE_MODEL["n_layers"] * MOE_CONFIG["max_steps"]
        assert all(sorted(c)[:-1] == [0, 0, 0] for c in r["counts"])
        assert len(r["history"]["batch_loss"]) == MOE_CONFIG["max_steps"]
    assert ranks[0]["history"] == ranks[1]["history"]
    for name, value in ranks[0]["state"].items():
        torch.testing.assert_close(torch.tensor(ranks[1]["state"][name]), torch.tensor(value),
                                   rtol=0, atol=0)
    # the busy expert of layer 0 learned; the idle ones moved only by weight decay
    busy = {max(range(4), key=c.__getitem__) for c in ranks[0]["counts"][::MOE_MODEL["n_layers"]]}
    assert len(busy) == 1
    torch.manual_seed(0)
    start = GPT(GPTConfig(**MOE_MODEL)).state_dict()
    key = "blocks.0.ffn.experts.{}.w_up.weight"
    moved = [(torch.tensor(ranks[0]["state"][key.format(e)]) - start[key.format(e)]).abs().max().item()
             for e in range(4)]
    idle = [m for e, m in enumerate(moved) if e not in busy]
    assert moved[busy.pop()] > 10 * max(idle)


def test_a_batch_that_does_not_split_evenly_is_rejected(monkeypatch):
    monkeypatch.setattr(distributed, "rank_and_size", lambda: (0, 3))
    model = GPT(GPTConfig(**MODEL))
    with pytest.raises(ValueError, match="batch_size=8 must be divisible by the number of processes"):
        train(model, _data(), None, TrainConfig(**CONFIG), progress=False)


def test_the_ranks_rows_tile_the_global_batch():
    rows = [distributed.batch_rows(12, rank, 4) for rank in range(4)]
    assert [(r.start, r.stop) for r in rows] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert distributed.batch_rows(8, 0, 1) == slice(0, 8)


def test_get_batch_with_rows_is_that_slice_of_the_whole_batch_and_draws_alike():
    """A process gathers only its rows, yet its generator advances as if it drew the whole batch,
    so the next batch is the same in every process."""
    data = torch.arange(1000)
    whole_gen, part_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x, y = get_batch(data, 8, 16, generator=whole_gen)
    px, py = get_batch(data, 8, 16, generator=part_gen, rows=slice(4, 8))
    assert torch.equal(px, x[4:8]) and torch.equal(py, y[4:8])
    assert torch.equal(whole_gen.get_state(), part_gen.get_state())


def test_each_process_takes_the_gpu_named_by_local_rank(monkeypatch):
    """Under torchrun a CUDA device becomes cuda:LOCAL_RANK and is made current (before, every
    process landed on cuda:0). No GPU is needed: torch.cuda.set_device is recorded, not called."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(distributed, "rank_and_size", lambda: (7, 8))  # rank 7 = machine 2, GPU 3
    assert distributed.local_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert distributed.local_device(torch.device("cuda", 0)) == torch.device("cuda", 3)
    assert calls == [3, 3]
    assert distributed.local_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(distributed, "rank_and_size", lambda: (0, 1))
    assert distributed.local_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert calls == [3, 3]  # a single process keeps the device it was given


def test_train_feeds_each_process_only_its_rows(monkeypatch):
    """train() as process 1 of 2 (the collective calls replaced by single-process stand-ins): every
    step's forward sees the second half of the batch one process would draw."""
    monkeypatch.setattr(distributed, "rank_and_size", lambda: (1, 2))
    monkeypatch.setattr(distributed, "wrap", lambda model, device: model)
    monkeypatch.setattr(distributed, "barrier", lambda: None)
    monkeypatch.setattr(distributed, "mean_over_processes", lambda values: values)
    seen = []
    model = GPT(GPTConfig(**MODEL))
    original = model.forward

    def recording(x, y):
        if model.training:
            seen.append(x.clone())
        return original(x, y)

    model.forward = recording
    config = TrainConfig(**CONFIG)
    train(model, _data(), None, config, progress=False)
    generator = torch.Generator().manual_seed(config.seed)
    expected = [get_batch(_data(), config.batch_size, config.context_length, generator)[0][4:]
                for _ in range(config.max_steps)]
    assert len(seen) == config.max_steps
    assert all(torch.equal(a, b) for a, b in zip(seen, expected))
