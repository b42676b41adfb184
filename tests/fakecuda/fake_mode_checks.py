"""Checks under FakeTensorMode on fake CUDA: run by tests/test_fake_cuda.py in a process with the
shim loaded (``python -m tests.fakecuda --capability 7.5 --no-wrapper <this file>``), never
collected by the plain unit-test run (its name does not start with ``test_``).

Fake tensors carry shapes, dtypes and devices but no values, so these steps take seconds at the
GPU profile's full size (6 x 384, batch 64 x 256), which the CPU could not train in CI."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from lib.config import GPTConfig
from lib.model import GPT
from lib.profiles import gpu_profile
from lib.training import _autocast, configure_optimizer

ROOT = Path(__file__).resolve().parents[2]
CAPABILITY = tuple(int(p) for p in os.environ["GPTBOOK_FAKE_CUDA_CAPABILITY"].split("."))
CUDA = torch.device("cuda")
AMP_DTYPE = torch.bfloat16 if CAPABILITY >= (8, 0) else torch.float32
# A T4 (Colab's free GPU) reports 15.8e9 bytes; about 15e9 are usable after the CUDA context.
# MemTracker counts tensors only (the caching allocator's fragmentation, cuBLAS workspaces and
# torch.compile's buffers are not in it), while on fake CUDA attention takes SDPA's math path
# and keeps every head's full score matrix, which a T4's memory-efficient kernel does not
# (measured at capability 7.5: 11's GPU profile 4.14 GiB here, 3.01 GiB with a stand-in that saves only q, k, v
# and the output). So the peak is neither a floor nor a ceiling; MARGIN = 2 is a judgement,
# not a measurement, and no real GPU has checked it yet.
T4_USABLE_BYTES = 15e9
MARGIN = 2.0
PROFILE = gpu_profile(vocab_size=65)


@pytest.fixture
def fake():
    with FakeTensorMode() as mode, torch.device("cuda"):
        yield mode


def test_the_fake_device_is_what_the_process_was_asked_for():
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == CAPABILITY
    assert torch.accelerator.current_accelerator() == torch.device("cuda")


def _step(model, optimizer, ids):
    with _autocast(CUDA, amp=True):
        logits, loss = model(ids, ids)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), PROFILE.train.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return logits, loss


def test_gpu_profile_step_devices_and_dtypes(fake):
    """One training step of the GPU profile as train() runs it on CUDA: bf16 autocast only
    from capability 8.0 (a T4 trains in float32), float32 loss and weights, fused AdamW."""
    model = GPT(PROFILE.model)
    ids = torch.randint(0, 65, (PROFILE.train.batch_size, PROFILE.train.context_length))
    optimizer = configure_optimizer(model, PROFILE.train.lr, PROFILE.train.weight_decay,
                                    PROFILE.train.betas)
    assert optimizer.defaults["fused"] is True  # lib picks the fused kernel on CUDA
    logits, loss = _step(model, optimizer, ids)
    assert logits.device.type == loss.device.type == "cuda"
    assert logits.dtype == AMP_DTYPE and loss.dtype == torch.float32
    for p in model.parameters():
        assert p.device.type == "cuda" and p.dtype == torch.float32
        state = optimizer.state[p]
        assert state["exp_avg"].device.type == "cuda"


def test_compiled_forward_traces_whole_on_cuda(fake):
    """torch.compile as train() applies it on CUDA, with fullgraph=True: a graph break that
    exists only on the CUDA path fails here (backend aot_eager: traced, not run by Inductor)."""
    model = GPT(PROFILE.model)
    ids = torch.randint(0, 65, (4, PROFILE.train.context_length))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with _autocast(CUDA, amp=True):
        logits, loss = compiled(ids, ids)
    assert logits.device.type == "cuda" and logits.dtype == AMP_DTYPE
    loss.backward()
    assert all(p.grad is not None and p.grad.device.type == "cuda"
               for p in model.parameters())


def test_a_cpu_tensor_in_a_cuda_forward_raises(fake):
    model = GPT(GPTConfig.tiny())
    with pytest.raises(RuntimeError, match="same device"):
        model(torch.randint(0, 65, (2, 8), device="cpu"))


def _peak(fn, *modules_and_optimizers) -> int:
    tracker = MemTracker()
    tracker.track_external(*modules_and_optimizers)
    with tracker:
        fn(tracker)
    peaks = tracker.get_tracker_snapshot("peak")
    return int(sum(stats["Total"] for device, stats in peaks.items()
                   if torch.device(device).type == "cuda"))


def _gpu_profile_peak() -> int:
    model = GPT(PROFILE.model)
    optimizer = configure_optimizer(model, PROFILE.train.lr, PROFILE.train.weight_decay,
                                    PROFILE.train.betas)
    ids = torch.randint(0, 65, (PROFILE.train.batch_size, PROFILE.train.context_length))

    def two_steps(tracker):  # the second has the optimizer's state beside the activations
        for _ in range(2):
            tracker.reset_mod_stats()
            _step(model, optimizer, ids)
    return _peak(two_steps, model, optimizer)


# Every `gpu=` the chapters pick, and what it costs in GPU memory. A setting that changes only
# how long or how often something runs (steps, seeds) leaves the peak of a step as it is; the
# one that changes a step's size (11's GPU profile) is measured.
GPU_SETTINGS = {
    "11_training": {
        "gpu=gpu_profile(V, max_steps=1000))": _gpu_profile_peak,
        "over_cfg = TrainConfig(max_steps=env.pick(cpu=300, gpu=1500), batch_size=16,": None,
        "eval_interval=env.pick(cpu=20, gpu=100), eval_batches=4, seed=0,": None},
    "12a_architecture_training": {
        "SEEDS = env.pick(cpu=[0, 1, 2, 3, 4], gpu=[0, 1, 2, 3, 4, 5])": None,
        "STEPS = env.pick(cpu=100, gpu=2000)": None},
}


def _chapter_gpu_picks() -> dict[str, set[str]]:
    """Each chapter's code lines that pick a `gpu=` value, stripped."""
    found = {}
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        lines = {line.strip() for c in cells if c["cell_type"] == "code"
                 for line in "".join(c["source"]).splitlines() if re.search(r"\bgpu\s*=", line)}
        if lines:
            found[path.stem] = lines
    return found


def test_every_gpu_setting_of_the_chapters_is_accounted_for():
    expected = {name: set(settings) for name, settings in GPU_SETTINGS.items()}
    assert _chapter_gpu_picks() == expected, (
        "a chapter's gpu= setting changed (any edit of its line counts): file the line in "
        "GPU_SETTINGS, with a function measuring its peak if it changes a step's size")


@pytest.mark.parametrize("chapter,setting", [(c, s) for c, d in GPU_SETTINGS.items()
                                             for s, f in d.items() if f is not None])
def test_gpu_settings_fit_a_t4_with_margin(fake, chapter, setting, record_property):
    peak = GPU_SETTINGS[chapter][setting]()
    record_property("peak_gib", peak / 2**30)
    print(f"{chapter} {setting}: peak {peak / 2**30:.2f} GiB at capability {CAPABILITY}")
    assert peak > 0
    assert MARGIN * peak <= T4_USABLE_BYTES, f"{peak / 2**30:.2f} GiB"
