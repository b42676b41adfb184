"""What only a GPU can check: mixed precision, torch.compile and fused AdamW in train() against
float32 eager training; bf16 generation with and without the KV cache; resuming with the CUDA
random state. Every test skips, saying why, on a machine without CUDA (CI runs on CPUs; these run
wherever a GPU is present: ``pytest tests/test_cuda.py``)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from lib.checkpoint import load_checkpoint
from lib.model import GPT, GPTConfig
from lib.training import TrainConfig, _autocast, autocast_dtype, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: these tests need a GPU")

VOCAB = 11
MODEL = GPTConfig.tiny(vocab_size=VOCAB, context_length=32, d_model=64, n_layers=2, n_heads=4,
                       d_ff=256, positions="rope", dropout=0.0)


def _data() -> torch.Tensor:
    return torch.arange(4000) * 7 % VOCAB  # a repeating pattern the model learns quickly


def _config(**overrides) -> TrainConfig:
    values = dict(max_steps=12, batch_size=16, context_length=32, lr=3e-3, min_lr=3e-4,
                  warmup_steps=2, eval_interval=6, eval_batches=2, seed=0, device="cuda")
    values.update(overrides)
    return TrainConfig(**values)


def _gpu_model(config: GPTConfig = MODEL, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).cuda()


def test_autocast_dtype_is_bf16_exactly_where_the_gpu_runs_it_natively():
    device = torch.device("cuda")
    major, _ = torch.cuda.get_device_capability(device)
    expected = torch.bfloat16 if major >= 8 else None
    assert autocast_dtype(device) == expected
    model = _gpu_model()
    x = _data()[:64].view(2, 32).cuda()
    with _autocast(device, amp=True):
        logits, _ = model(x, x)
    assert logits.dtype == (torch.bfloat16 if major >= 8 else torch.float32)


def test_amp_compile_and_fused_adamw_track_float32_eager_training():
    """A few steps with everything the GPU profile switches on (bf16 autocast where native,
    torch.compile, fused AdamW) against the same steps in float32, eager, with torch's default
    AdamW kernel: the losses agree to bf16 precision and the weights move the same way."""
    start = _gpu_model()
    fast, reference = copy.deepcopy(start), copy.deepcopy(start)
    h_fast = train(fast, _data(), _data(), _config(amp=True, compile=True, fused_adamw=True),
                   progress=False)
    h_ref = train(reference, _data(), _data(), _config(amp=False, compile=False, fused_adamw=False),
                  progress=False)
    torch.testing.assert_close(torch.tensor(h_fast.batch_loss), torch.tensor(h_ref.batch_loss),
                               rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(torch.tensor(h_fast.val_loss), torch.tensor(h_ref.val_loss),
                               rtol=3e-2, atol=3e-2)
    assert h_ref.val_loss[-1] < h_ref.val_loss[0] - 0.2  # the run really trained
    moved = torch.cat([(r - s).flatten() for r, s in zip(reference.parameters(), start.parameters())])
    apart = torch.cat([(f - r).flatten() for f, r in zip(fast.parameters(), reference.parameters())])
    assert apart.norm() < 0.3 * moved.norm()


def test_bf16_generation_with_and_without_the_kv_cache():
    """A trained model in bfloat16 generates greedily with and without its KV cache. Each path's
    every choice is (within bf16 rounding) the arg-max of the float32 model's logits on that
    path's own sequence, and the bf16 logits of the whole sequence match the float32 ones."""
    model = _gpu_model()
    train(model, _data(), None, _config(max_steps=200, eval_interval=200, lr=1e-2, min_lr=1e-3,
                                        warmup_steps=10), progress=False)
    half = copy.deepcopy(model).to(torch.bfloat16)
    prompt = _data()[:5].view(1, 5).cuda()
    cached = half.generate(prompt, 20, temperature=0.0, use_cache=True)
    uncached = half.generate(prompt, 20, temperature=0.0, use_cache=False)
    for out in (cached, uncached):
        assert out.shape == (1, 25)
        with torch.no_grad():
            logits32, _ = model(out[:, :-1], out[:, 1:])  # float32, one full forward pass
            logits16, _ = half(out[:, :-1], out[:, 1:])
        chosen = logits32[0, 4:].gather(-1, out[0, 5:, None]).squeeze(-1)
        assert (chosen >= logits32[0, 4:].max(-1).values - 0.25).all()
        torch.testing.assert_close(logits16.float(), logits32, rtol=0.05, atol=0.15)
    # the pattern is learned, so both paths continue it the same way
    assert torch.equal(cached, uncached)


def test_resume_restores_the_cuda_random_state(tmp_path):
    """With dropout on a GPU, the masks come from the CUDA generator: a run split in two sessions,
    resumed after the CUDA generator was moved elsewhere, equals the unbroken run (to GPU
    rounding, far tighter than a different dropout mask would give)."""
    config = _config(max_steps=20, eval_interval=5, amp=False)
    dropout = dataclasses.replace(MODEL, dropout=0.2)
    whole_model = _gpu_model(dropout)
    whole = train(whole_model, _data(), _data(), config, progress=False)

    path = tmp_path / "run.safetensors"
    train(_gpu_model(dropout), _data(), _data(), config, checkpoint_path=path, stop_at=8,
          progress=False)
    assert "cuda" in load_checkpoint(path, _gpu_model(dropout)).rng
    torch.cuda.manual_seed(12345)  # anything the state was not restored from would differ now
    resumed_model = _gpu_model(dropout, seed=3)
    resumed = train(resumed_model, _data(), _data(), config, checkpoint_path=path, resume=True,
                    progress=False)
    torch.testing.assert_close(torch.tensor(resumed.batch_loss), torch.tensor(whole.batch_loss),
                               rtol=1e-5, atol=1e-5)
    for a, b in zip(resumed_model.parameters(), whole_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    # the masks really come from the CUDA generator: seeded alike they repeat, else they differ
    x = _data()[:64].view(2, 32).cuda()
    resumed_model.train()
    torch.cuda.manual_seed(777)
    first = resumed_model(x, x)[1]
    torch.cuda.manual_seed(777)
    assert torch.equal(resumed_model(x, x)[1], first)
    assert not torch.equal(resumed_model(x, x)[1], first)
