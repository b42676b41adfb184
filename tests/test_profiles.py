"""lib.profiles: the CPU and GPU training profiles are valid, consistent configs."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lib.model import GPT
from lib.attention import MultiHeadAttention
from lib.cpu_kernels import CPUMultiHeadAttention
from lib.profiles import Profile, cpu_profile, gpu_profile
from lib.training import train


@pytest.mark.parametrize("make", [cpu_profile, gpu_profile])
def test_profiles_are_consistent(make):
    profile = make(65, max_steps=500)
    assert isinstance(profile, Profile)
    assert profile.train.max_steps == 500
    assert profile.train.context_length <= profile.model.context_length
    assert profile.model.vocab_size == 65


def test_cpu_profile_model_takes_the_cpu_path_and_computes_what_gpt_computes():
    """The CPU profile's config (cpu_kernels=True) builds lib.cpu_kernels' attention; its logits,
    and one AdamW step with the fused kernel the profile asks for, equal a plain GPT's (same
    weights) with foreach AdamW."""
    profile = cpu_profile(11, max_steps=50)
    assert profile.train.fused_adamw is True
    torch.manual_seed(0)
    model = profile.new_model()
    assert all(type(b.attn) is CPUMultiHeadAttention for b in model.blocks)
    torch.manual_seed(0)
    plain = GPT(replace(profile.model, cpu_kernels=False))
    assert all(type(b.attn) is MultiHeadAttention for b in plain.blocks)
    ids = torch.randint(0, 11, (4, 64), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(ids, -1, dims=1)
    for m, fused in ((model, True), (plain, False)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused, foreach=not fused)
        m(ids, targets)[1].backward()
        opt.step()
    torch.testing.assert_close(model(ids)[0], plain(ids)[0], rtol=1e-4, atol=1e-4)
    gpu = gpu_profile(11)
    assert profile.model.cpu_kernels and not gpu.model.cpu_kernels
    assert all(type(b.attn) is MultiHeadAttention for b in gpu.new_model().blocks)


def test_cpu_profile_trains_a_few_steps():
    profile = cpu_profile(11, max_steps=50)
    data = torch.arange(2000) % 11
    config = profile.train.__class__(**{**profile.train.to_dict(), "max_steps": 3, "warmup_steps": 1,
                                        "eval_interval": 3, "eval_batches": 1, "batch_size": 2,
                                        "betas": tuple(profile.train.betas)})
    history = train(GPT(profile.model), data, data, config, progress=False)
    assert len(history.batch_loss) == 3


def test_gpu_profile_training_settings_run_on_the_cpu_where_amp_and_compile_are_ignored():
    profile = gpu_profile(11, max_steps=200)
    small_model = profile.model.__class__(**{**profile.model.to_dict(), "d_model": 24, "n_heads": 2,
                                             "n_layers": 1, "d_ff": 48, "context_length": 16})
    values = {**profile.train.to_dict(), "max_steps": 2, "warmup_steps": 1, "eval_interval": 2,
              "eval_batches": 1, "batch_size": 2, "context_length": 16}
    config = profile.train.__class__.from_dict(values)
    assert config.amp and config.compile
    data = torch.arange(500) % 11
    history = train(GPT(small_model), data, None, config, progress=False)
    assert len(history.batch_loss) == 2 and all(torch.isfinite(torch.tensor(history.batch_loss)))
